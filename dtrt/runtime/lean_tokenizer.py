"""A pipeline's tokenizer without transformers: the Rust tokenizer transformers builds from the files (its
`tokenizers` backend, serialized) and the chat template rendered in the Jinja environment transformers renders it in.
Importing transformers took about a second of every `dtrt run` (1.0 of 3.1 s on 2 cores); the tokenizers library and
jinja2, which transformers itself runs on, take a tenth of that.

A record is made once per tokenizer files and versions of transformers, tokenizers and jinja2
(dtrt.runtime.tokenizer.open_tokenizer keeps it in dtrt.artifacts.memo), from the tokenizer transformers loads: its
backend as JSON, the ids and strings the pipeline reads, and the chat template. It is made only where the lean
tokenizer gives transformers' results on probes (texts, every special id and a spread of others, chats of every role
with thinking on and off): a slow tokenizer, one that splits special tokens or cleans up decoded spaces, a template
that renders otherwise, get a record that says why, and transformers' tokenizer is used. A chat the lean template
cannot render (an error, a message with more than role and content) goes to transformers' tokenizer, loaded then.
"""

import json
from collections.abc import Callable
from copy import copy
from datetime import datetime
from importlib import metadata

RULE = 1  # the record's layout and probes: a change makes every record again

ROLES = ("system", "developer", "user", "assistant")  # dtrt.frontend.requests.ROLES
PROBE_TEXTS = (
    "Hello, world!",
    " a leading space, two  inside and one at the end ",
    "tabs\tand\nnew lines\n\n\r\n",
    "Unicode: café, naïve, 日本語, Ελληνικά, emoji 🙂👍🏽",
    "numbers 12345 3.14159 1e-9",
    "def f(x):\n    return x ** 2  # a comment",
    "",
)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def record_kind() -> str:
    """The memo's kind of a record: the versions whose behaviour it recorded (read without importing them)."""
    versions = "/".join(f"{m}-{_version(m)}" for m in ("transformers", "tokenizers", "jinja2"))
    return f"lean-tokenizer/{RULE}/{versions}"


def _template_env():
    """transformers' chat template environment (`_compile_jinja_template` in transformers.utils.chat_template_utils):
    the same sandbox, options, extensions, filters and globals."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it for masks only)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


class LeanTokenizer:
    """What dtrt's pipelines read of a Hugging Face tokenizer, over its recorded backend: encode, decode, the special
    ids, the chat template. `fallback()` gives transformers' tokenizer of the same files, for a chat this one does not
    render; it loads that tokenizer once (open_tokenizer's keeps it)."""

    def __init__(self, record: dict, fallback: Callable[[], object]):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(record["backend"])
        self.eos_token_id, self.bos_token_id = record["eos_token_id"], record["bos_token_id"]
        self.all_special_ids = list(record["all_special_ids"])
        self.special_tokens_map = dict(record["special_tokens_map"])
        self.chat_template = record["chat_template"]
        self._fallback, self._template = fallback, None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> list[int]:
        """transformers' encode of one text (`verbose` only warns there)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def hf(self):
        """transformers' tokenizer of the same files (loaded on the first call)."""
        return self._fallback()

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True, **kw
    ):
        """The chat's text as transformers renders it (`tokenize=False` only: dtrt encodes the text itself)."""
        if tokenize:
            raise TypeError("LeanTokenizer.apply_chat_template renders text only: pass tokenize=False")
        try:
            return self._render(messages, add_generation_prompt, kw)
        except Exception:  # noqa: BLE001 - transformers decides: its text, or its own error
            return self.hf().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
            )

    def _render(self, messages: list[dict], add_generation_prompt: bool, kw: dict) -> str:
        if not isinstance(self.chat_template, str):
            raise ValueError("no chat template")
        if any(not isinstance(m, dict) or set(m) - {"role", "content"} for m in messages):
            raise ValueError("only role and content are rendered here")  # transformers renames reasoning fields
        if any(not isinstance(v, str | bool | int | float) for v in kw.values()):
            raise ValueError("plain template arguments only")
        if self._template is None:
            self._template = _template_env().from_string(self.chat_template)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kw},
        )


def make_record(hf) -> dict:
    """The record of transformers' tokenizer `hf`: its backend and what the pipeline reads ("backend" None, with
    "why", where the lean tokenizer would not give its results)."""
    why = _refusal(hf)
    if why is None:
        backend = copy(hf.backend_tokenizer)
        backend.no_padding()  # as transformers' encode and llguidance's copy turn them off
        backend.no_truncation()
        template = hf.chat_template
        record = {
            "backend": backend.to_str(),
            "eos_token_id": hf.eos_token_id,
            "bos_token_id": hf.bos_token_id,
            "all_special_ids": [int(i) for i in hf.all_special_ids],
            "special_tokens_map": {k: str(v) for k, v in hf.special_tokens_map.items()},
            "chat_template": template,
        }
        why = differs(LeanTokenizer(record, lambda: hf), hf)
        if why is None:
            return record
    return {"backend": None, "why": why}


def _refusal(hf) -> str | None:
    if getattr(hf, "backend_tokenizer", None) is None:
        return "a tokenizer without a tokenizers backend"
    if getattr(hf, "split_special_tokens", False):
        return "it splits special tokens"
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    forced = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if getattr(hf, "clean_up_tokenization_spaces", False) and (forced or not bpe):
        return "its decode cleans up spaces"
    if hf.chat_template is not None and not isinstance(hf.chat_template, str):
        return "named chat templates"
    if _version("tokenizers") is None or _version("jinja2") is None:
        return "no tokenizers or jinja2 package"
    jinja = tuple(int(x) for x in _version("jinja2").split(".")[:3] if x.isdigit())
    if jinja < (3, 1, 6):  # transformers refuses older ones: their sandbox has known escapes
        return "jinja2 older than 3.1.6"
    return None


def _chats(special: list[str]) -> list[list[dict]]:
    """Probe chats: each role before a user turn, a second turn, special tokens and odd text in the contents."""
    odd = "".join(special) + " <|im_end|> </s> " + PROBE_TEXTS[3]
    chats = [[{"role": "user", "content": t}] for t in (*PROBE_TEXTS, odd)]
    chats += [[{"role": r, "content": "Be brief."}, {"role": "user", "content": "Hi"}] for r in ROLES]
    chats.append(
        [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": odd},
        ]
    )
    chats.append([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}])
    return chats


def differs(lean: LeanTokenizer, hf) -> str | None:
    """Where `lean` does not give `hf`'s results on the probes (None: nowhere)."""
    same = (lean.eos_token_id, lean.bos_token_id, lean.all_special_ids, len(lean), lean.vocab_size) == (
        hf.eos_token_id,
        hf.bos_token_id,
        list(hf.all_special_ids),
        len(hf),
        hf.vocab_size,
    )
    if not same:
        return "special ids or vocabulary sizes"
    special = [t for t in (hf.convert_ids_to_tokens(i) for i in hf.all_special_ids) if isinstance(t, str)]
    texts = [*PROBE_TEXTS, " ".join(special) + " between " + "".join(special)]
    thinking = (False, True) if "enable_thinking" in str(lean.chat_template or "") else (False,)
    if lean.chat_template is not None:
        for chat in _chats(special):
            for think in thinking:
                try:
                    want = hf.apply_chat_template(
                        chat, add_generation_prompt=True, tokenize=False, enable_thinking=think
                    )
                except Exception:  # noqa: BLE001 - a template's own refusal: the lean one must refuse too
                    want = None
                try:
                    got = lean._render(chat, True, {"enable_thinking": think})
                except Exception:  # noqa: BLE001
                    got = None
                if got != want:
                    return f"the chat template renders {chat[0]['role']!r} chats otherwise"
                if want is not None:
                    texts.append(want)
    for text in texts:
        for add in (False, True):
            ids = hf.encode(text, add_special_tokens=add)
            if lean.encode(text, add_special_tokens=add) != ids:
                return "encodes otherwise"
            for skip in (False, True):
                if lean.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                    return "decodes otherwise"
    n = len(hf)
    ids = sorted({*hf.all_special_ids, *range(min(n, 512)), *range(0, n, max(1, n // 997)), n - 1})
    for i in ids:
        if lean.convert_ids_to_tokens(i) != hf.convert_ids_to_tokens(i):
            return "maps ids to tokens otherwise"
        for skip in (False, True):
            if lean.decode([i], skip_special_tokens=skip) != hf.decode([i], skip_special_tokens=skip):
                return "decodes single ids otherwise"
    return None

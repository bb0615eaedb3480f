"""The OpenAI wire format: request bodies checked into a Request, and the completion, chunk and error bodies."""

import time
import uuid
from dataclasses import dataclass

from dtrt.runtime.requests import Request, RequestError, parse_request
from dtrt.runtime.text import Completion

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}
# OpenAI parameters dtrt takes only at their neutral value: anything else would change the output silently
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),
}
IGNORED = ("user", "metadata", "store", "service_tier")


@dataclass
class OpenAIRequest:
    request: Request
    model: str | None
    stream: bool
    include_usage: bool


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
    for key, ok in NEUTRAL.items():
        value = body.pop(key, None)
        if value is not None and value not in ok:
            raise RequestError(
                f"{key} {value!r}: not supported (dtrt serves one exact sequence per request); omit it", key
            )
    for key in IGNORED:
        body.pop(key, None)
    model, stream, options = body.pop("model", None), body.pop("stream", False), body.pop("stream_options", None)
    if model is not None and not isinstance(model, str):
        raise RequestError("model: must be a string", "model")
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
    return OpenAIRequest(req, model, stream, bool((options or {}).get("include_usage")))


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(c: Completion) -> dict:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.tokens),
        "total_tokens": c.prompt_tokens + len(c.tokens),
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
        "decode_s": g.decode_s,
    }


def completion_body(rid: str, model: str, chat: bool, c: Completion, method: str) -> dict:
    finish = FINISH[c.stop_reason]
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(c),
        "dtrt": stats(c, method),
    }


def chunk_body(
    rid: str,
    model: str,
    chat: bool,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
    usage_: dict | None = None,
) -> dict:
    """One server-sent event: a text delta, the opening role (chat), the finish reason, or the usage (no choices)."""
    if usage_ is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
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

"""`dtrt run` at a terminal: one generation streamed as it is committed, Ctrl-C that ends a generation at its next
round instead of tearing it down mid-stage, and the interactive prompt loop."""

import signal
import threading
from dataclasses import replace

from dtrt.errors import DtrtError
from dtrt.frontend.requests import Request, RequestError, encode, fit_prompt, has_chat_template
from dtrt.frontend.text import Completion, complete

NEW_CHAT = "/new"


class Interrupt:
    """While active, Ctrl-C (SIGINT) only sets a flag (call the object to read it); a second Ctrl-C raises
    KeyboardInterrupt as usual. Outside the main thread, where signals cannot be caught, it never fires."""

    def __init__(self):
        self.hit = False
        self._old = None

    def __enter__(self):
        self.hit = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return False

    def __call__(self) -> bool:
        return self.hit


def stats_line(c: Completion, method: str) -> str:
    out = c.generation
    end = "" if c.stop_reason in ("eos", "length") else f"  ({c.stop_reason})"
    return (
        f"[{method}] tau {out.tau:.2f}  {out.tokens_per_s:.1f} tok/s  {len(out.tokens)} tokens  "
        f"{len(out.rounds)} rounds  prefill {out.prefill_s * 1e3:.0f} ms{end}"
    )


def prompt_ids(pipe, req: Request, chat: bool, truncate: bool) -> list[int]:
    """The request's prompt rendered, encoded and fitted to the context (or an error naming the numbers)."""
    return fit_prompt(pipe, encode(pipe.tokenizer, req, chat), req.max_new_tokens, truncate)


def generate_one(pipe, req: Request, ids: list[int], write=None) -> Completion:
    """One generation with `write(text)` streaming it; Ctrl-C ends it with stop_reason "cancelled"."""
    with Interrupt() as interrupted:
        return complete(pipe, ids, req.max_new_tokens, req.sampling, req.stop, write, interrupted)


def repl(pipe, defaults: Request, chat: bool, truncate: bool, read_line, write, log):
    """One prompt per line, each generated and streamed in turn. Through the chat template the lines are one
    conversation: each prompt carries the earlier turns and replies (the oldest dropped when they no longer fit,
    `/new` starts over); raw prompts (--no-chat, or no template) stand alone. Ctrl-C during a generation ends it
    and returns to the prompt; Ctrl-D or Ctrl-C at the prompt ends the loop. `read_line(prompt)` is `input` at a
    terminal."""
    history: list[dict] | None = [] if chat and has_chat_template(pipe.tokenizer) else None
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if not line.strip():
            continue
        if history is not None and line.strip() == NEW_CHAT:
            history.clear()
            log("(new conversation)")
            continue
        try:
            req, ids = _turn(pipe, defaults, line, history, chat, truncate, log)
            c = generate_one(pipe, req, ids, write)
        except DtrtError as e:
            log(f"error: {e}")
            continue
        write("\n")
        log(stats_line(c, pipe.spec.method))
        if history is not None:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": c.text}]


def _turn(pipe, defaults: Request, line: str, history: list[dict] | None, chat: bool, truncate: bool, log):
    """The request of one interactive line and its prompt ids, dropping the oldest exchanges that do not fit."""
    if history is None:
        req = replace(defaults, prompt=line)
        return req, prompt_ids(pipe, req, chat, truncate)
    user = {"role": "user", "content": line}
    for start in range(0, len(history) + 1, 2):
        req = replace(defaults, messages=[*history[start:], user])
        try:
            ids = prompt_ids(pipe, req, chat, truncate=False)
        except RequestError:
            if start == len(history):  # the line alone does not fit
                return req, prompt_ids(pipe, req, chat, truncate)
            continue
        if start:
            log(f"(the {start // 2} oldest exchanges no longer fit the context and were dropped)")
            del history[:start]
        return req, ids

"""`dtrt run` at a terminal: one generation streamed as it is committed, Ctrl-C that ends a generation at its next
round instead of tearing it down mid-stage, and the interactive prompt loop."""
import signal
import threading
from dataclasses import replace

from dtrt.errors import DtrtError
from dtrt.runtime.requests import Completion, Request, complete, encode, fit_prompt


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
    return (f"[{method}] tau {out.tau:.2f}  {out.tokens_per_s:.1f} tok/s  {len(out.tokens)} tokens  "
            f"{len(out.rounds)} rounds  prefill {out.prefill_s * 1e3:.0f} ms{end}")


def prompt_ids(pipe, req: Request, chat: bool, truncate: bool) -> list[int]:
    """The request's prompt rendered, encoded and fitted to the context (or an error naming the numbers)."""
    return fit_prompt(pipe, encode(pipe.tokenizer, req, chat), req.max_new_tokens, truncate)


def generate_one(pipe, req: Request, ids: list[int], write=None) -> Completion:
    """One generation with `write(text)` streaming it; Ctrl-C ends it with stop_reason "cancelled"."""
    with Interrupt() as interrupted:
        return complete(pipe, ids, req.max_new_tokens, req.sampling, req.stop, write, interrupted)


def repl(pipe, defaults: Request, chat: bool, truncate: bool, read_line, write, log):
    """One prompt per line, each generated and streamed in turn. Ctrl-C during a generation ends it and returns to
    the prompt; Ctrl-D or Ctrl-C at the prompt ends the loop. `read_line(prompt)` is `input` at a terminal."""
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if not line.strip():
            continue
        req = replace(defaults, prompt=line)
        try:
            c = generate_one(pipe, req, prompt_ids(pipe, req, chat, truncate), write)
        except DtrtError as e:
            log(f"error: {e}")
            continue
        write("\n")
        log(stats_line(c, pipe.draft.method))

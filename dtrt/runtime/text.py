"""A generation as text: committed tokens decoded incrementally, streamed as they become final, and cut before the
first stop string. `complete` drives a pipeline's stream of rounds and ends it early at a stop string or when the
caller cancels (Ctrl-C, a client gone)."""

from dataclasses import dataclass

from dtrt.runtime.generate import Generation
from dtrt.runtime.sampling import SamplingConfig

STAGES = ("draft", "build", "verify", "commit")


class TextStream:
    """Committed tokens in, text out: what may be shown so far, cut before the first stop string.

    Decoding is incremental: only a window of the latest tokens is decoded per token (the text of
    tokens[prefix:] minus that of tokens[prefix:read], so tokenizers that drop a leading space at the start of a
    decode still give the whole decode's text), so streaming costs time linear in the output's length.
    An incomplete UTF-8 character at the end (decoded as U+FFFD) and a suffix that could still grow into a stop
    string are held back until later tokens decide them, so nothing shown is ever taken back. The characters
    before such an incomplete one are final already: they count for the stop strings at once.

    Stop strings are looked for after every token, so the text and the tokens kept do not depend on how the tokens
    were grouped into pushes (one per AR round, several per speculative round)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""  # the final characters so far
        self.sent = 0  # characters handed out
        self.stopped = False
        self._prefix = self._read = 0  # tokens[_prefix:_read] are decoded into _done; the window starts at _prefix
        self._done = ""  # the text of tokens[:_read]
        self._window: int | None = 0  # len(decode(tokens[_prefix:_read])), None until the next token needs it

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _advance(self, final: bool = False):
        """Take into text what the tokens after _read add: all of it once it ends with a whole character (or at
        the end), else the characters before the incomplete one (the window stays open for the rest)."""
        if self._window is None:
            self._window = len(self._decode(self.tokens[self._prefix : self._read]))
        new = self._decode(self.tokens[self._prefix :])
        if len(new) <= self._window:  # nothing added yet (special tokens only)
            return
        if final or not new.endswith("\ufffd"):
            self._done += new[self._window :]
            self.text = self._done
            self._prefix, self._read, self._window = self._read, len(self.tokens), None
        else:
            self.text = self._done + new[self._window :].rstrip("\ufffd")

    def _find_stop(self) -> int | None:
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        text = self.text
        return max(
            (next((n for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])), 0) for s in self.stop),
            default=0,
        )

    def _take(self, end: int) -> str:
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta

    def push(self, tokens: list[int]) -> str:
        """The text that may be shown after these tokens (possibly empty). After a stop string, `tokens` ends with
        the token that completed it and `text` before it."""
        for t in tokens:
            self.tokens.append(t)
            self._advance()
            if self.stop and (hit := self._find_stop()) is not None:
                self.stopped = True
                self.text = self.text[:hit]
                return self._take(hit)
        return self._take(len(self.text) - self._held())

    def finish(self) -> str:
        """The held-back rest, once the generation has ended."""
        if self.stopped:
            return ""
        if self._read < len(self.tokens):
            self._advance(final=True)
        return self._take(len(self.text))


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

    def to_json(self, spec) -> dict:
        """The result object of `dtrt run --json` (and its JSONL lines), with `spec`'s method and budget."""
        out = self.generation
        return {
            "tokens": out.tokens,
            "text": self.text,
            "tau": out.tau,
            "tokens_per_s": out.tokens_per_s,
            "rounds": len(out.rounds),
            "method": spec.method,
            "budget": spec.budget,
            "prompt_tokens": self.prompt_tokens,
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "stop_reason": out.stop_reason,
            "stage_s": {k: sum(getattr(r, f"{k}_s") for r in out.rounds) for k in STAGES},
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
    stop string (stop_reason "stop"), and `cancelled()` turning true ends it after the round in flight
    ("cancelled")."""
    stream = TextStream(pipe.tokenizer, stop)
    gen = Generation()
    rounds = pipe.stream(ids, max_new_tokens, sampling)
    try:
        for step in rounds:
            gen.add(step)
            if on_text is not None or stop:
                delta = stream.push(step.tokens)
                if delta and on_text is not None:
                    on_text(delta)
                if stream.stopped:
                    gen.stop_reason = "stop"
                    break
            else:
                stream.tokens += step.tokens
            if cancelled is not None and cancelled():
                gen.stop_reason = "cancelled"
                break
    finally:
        rounds.close()
    rest = stream.finish()  # without listeners or stop strings: the tokens decoded here, once
    if rest and on_text is not None:
        on_text(rest)
    gen.tokens = stream.tokens
    return Completion(stream.text, gen, len(ids))

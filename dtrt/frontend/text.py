"""A generation as text: committed tokens decoded incrementally, streamed as they become final, and cut before the
first stop string. `complete` drives a pipeline's stream of rounds and ends it early at a stop string or when the
caller cancels (Ctrl-C, a client gone)."""

from dataclasses import dataclass

from dtrt.runtime.generate import Generation, TokenLogprob
from dtrt.runtime.sampling import SamplingConfig


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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece shows for each byte."""
    shown = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(shown), 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(shown, chars)}


BYTE_DECODER = _byte_decoder()


class TokenPieces:
    """Each token as OpenAI's logprobs show it: its text alone and its bytes (a byte-level BPE token that is part of
    a character has bytes but no text of its own: its text shows U+FFFD). Cached per token id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        if token not in self._cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            piece = self.tokenizer.convert_ids_to_tokens(token) if self.byte_level else None
            if piece is not None and all(c in BYTE_DECODER for c in piece):
                raw = list(bytes(BYTE_DECODER[c] for c in piece))
            else:
                raw = None if "\ufffd" in text else list(text.encode())
            self._cache[token] = (text, raw)
        return self._cache[token]

    def entries(self, tokens: list[int], logprobs: list[TokenLogprob]) -> list[dict]:
        """OpenAI's chat logprobs entries: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
        "bytes"}]} per token."""
        out = []
        for token, lp in zip(tokens, logprobs):
            text, raw = self(token)
            top = [{"token": t, "logprob": v, "bytes": b} for t, b, v in ((*self(i), v) for i, v in lp.top)]
            out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return out


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
        return self.generation.stats() | {
            "text": self.text,
            "method": spec.method,
            "budget": spec.budget,
            "prompt_tokens": self.prompt_tokens,
        }


def complete(
    pipe,
    ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop: tuple[str, ...] = (),
    on_text=None,
    cancelled=None,
    logprobs: int | None = None,
    into: Generation | None = None,
    grammar=None,
) -> Completion:
    """Generate after `ids`: `on_text(str)` receives the text as it becomes final, the output ends before the first
    stop string (stop_reason "stop"), and `cancelled()` turning true ends it after the round in flight
    ("cancelled"). `logprobs` k: the tokens' log-probabilities with k alternatives (Generation.logprobs). `into`:
    the Generation to fill, which `on_text` may read (the tokens so far, a stop string's already cut); `grammar`:
    the output follows it (dtrt.runtime.grammar.compile_format)."""
    stream = TextStream(pipe.tokenizer, stop)
    gen = into if into is not None else Generation()
    rounds = pipe.stream(ids, max_new_tokens, sampling, logprobs, grammar)
    try:
        for step in rounds:
            gen.add(step)
            if on_text is not None or stop:
                delta = stream.push(step.tokens)
                if stream.stopped:
                    gen.stop_reason = "stop"
                    gen.keep(len(stream.tokens))
                if delta and on_text is not None:
                    on_text(delta)
                if stream.stopped:
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

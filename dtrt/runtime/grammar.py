"""Structured output: a JSON schema (or any JSON object) compiled by llguidance into a grammar over the target's
tokenizer, and per generation the grammar's state at the committed tokens with the masks of a round's tree paths.

llguidance is imported only here and only when a request asks for a format (the `structured` extra). A path is the
tuple of tokens after the round's root (which is committed): its mask is computed by consuming the path on the one
matcher, filling the bitmask and rolling the path back, once per path and round."""

from dataclasses import dataclass

import numpy as np
import torch

from dtrt.errors import DtrtError
from dtrt.runtime.request_values import ResponseFormat

INSTALL = 'pip install -e ".[structured]"'
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""json.dumps's layout: with free whitespace a model may pad its output with blanks until max tokens (the tiny pair
does); a schema's own `x-guidance` options still override it."""


def _llguidance(field: str):
    try:
        import llguidance
        import llguidance.torch
    except ImportError:
        raise DtrtError(f"{field} needs the llguidance package: {INSTALL}") from None
    return llguidance


class _Tokens:
    """A tokenizer llguidance's TokenizerWrapper takes: each id's bytes, for a tokenizer whose decoder llguidance
    does not read (the tiny pairs' character-level BPE)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


_LL_TOKENIZERS: dict[int, tuple[object, object]] = {}


def _from_backend(ll, tokenizer):
    """llguidance's tokenizer over the Rust tokenizer itself, as llguidance.hf.from_tokenizer makes it from
    transformers' (without padding or truncation; the tokenizer's EOS), which a LeanTokenizer is recorded from."""
    from dtrt.runtime.lean_tokenizer import LeanTokenizer

    if not isinstance(tokenizer, LeanTokenizer):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer)
    return ll.LLTokenizer(tokenizer.backend_tokenizer.to_str(), eos_token=tokenizer.eos_token_id)


def ll_tokenizer(tokenizer, field: str = "response_format"):
    """llguidance's tokenizer for a Hugging Face one, made once per tokenizer object (about a second)."""
    got = _LL_TOKENIZERS.get(id(tokenizer))
    if got is not None and got[0] is tokenizer:
        return got[1]
    ll = _llguidance(field)
    try:
        made = _from_backend(ll, tokenizer)
    except ValueError:  # a decoder llguidance does not read: its tokens' bytes instead
        from llguidance._tokenizer import TokenizerWrapper

        made = ll.LLTokenizer(TokenizerWrapper(_Tokens(tokenizer)))
    _LL_TOKENIZERS[id(tokenizer)] = (tokenizer, made)
    return made


@dataclass(frozen=True)
class Grammar:
    """A compiled format over one tokenizer (llguidance's grammar text, checked); `GrammarState` runs it."""

    text: str
    tokenizer: object  # llguidance's LLTokenizer


_COMPILED: dict[tuple[int, str], tuple[object, Grammar]] = {}


def compile_format(fmt: ResponseFormat, tokenizer, field: str = "response_format") -> Grammar:
    """The format's grammar (kept per tokenizer and schema); an invalid schema or one with a feature llguidance does
    not implement is one DtrtError naming `field`."""
    got = _COMPILED.get((id(tokenizer), fmt.text))
    if got is not None and got[0] is tokenizer:
        return got[1]
    ll = _llguidance(field)
    tok = ll_tokenizer(tokenizer, field)
    try:
        text = ll.LLMatcher.grammar_from_json_schema(fmt.text, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise DtrtError(f"{field}: the schema is not a JSON object ({e})") from None
    failed, messages = ll.LLMatcher.validate_grammar_with_warnings(text, tok)
    if failed:
        why = " ".join(messages[0].split())
        what = "uses a feature dtrt cannot enforce" if "Unimplemented" in why else "is not a valid JSON schema"
        raise DtrtError(f"{field}: the schema {what}: {why}")
    if len(_COMPILED) >= 64:  # a server's schemas: the latest kept, not every one ever asked for
        _COMPILED.clear()
    grammar = _COMPILED[(id(tokenizer), fmt.text)] = (tokenizer, Grammar(text, tok))
    return grammar[1]


class GrammarState:
    """The grammar after a generation's committed tokens, and the masks of this round's paths (tuples of tokens
    after the committed ones): `allowed(path)` a bool array over `vocab` ids (ids past the tokenizer's: never),
    `forced(path)` the one token allowed there or None. `commit(tokens)` moves the state on and drops the masks."""

    def __init__(self, grammar: Grammar, vocab: int):
        ll = _llguidance("response_format")
        self._lt = ll.torch
        self.matcher = ll.LLMatcher(grammar.tokenizer, grammar.text)
        self.vocab, self.n = vocab, grammar.tokenizer.vocab_size
        self._bits = self._lt.allocate_token_bitmask(1, self.n)
        self._masks: dict[tuple, tuple[np.ndarray, int | None]] = {}

    def _mask(self, path: tuple) -> tuple[np.ndarray, int | None, np.ndarray]:
        got = self._masks.get(path)
        if got is not None:
            return got
        allowed = np.zeros(self.vocab, dtype=bool)
        consumed = self.matcher.try_consume_tokens(list(path)) if path else 0
        if consumed == len(path):
            self._lt.fill_next_token_bitmask(self.matcher, self._bits, 0)
            bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
            n = min(self.n, self.vocab)
            allowed[:n] = bits[:n].astype(bool)
        if consumed:
            self.matcher.rollback(consumed)
        ones = np.flatnonzero(allowed)
        forced = int(ones[0]) if len(ones) == 1 else None
        got = self._masks[path] = (allowed, forced, ones)
        return got

    def allowed(self, path: tuple = ()) -> np.ndarray:
        return self._mask(path)[0]

    def allows(self, path: tuple, token: int) -> bool:
        return bool(self._mask(path)[0][token])

    def forced(self, path: tuple = ()) -> int | None:
        return self._mask(path)[1]

    def commit(self, tokens: list[int]):
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the grammar refused committed tokens {tokens}: {self.matcher.get_error()}")
        self._masks.clear()

    def greedy(self, row: torch.Tensor, path: tuple) -> int:
        """The argmax of logits [V] among the tokens allowed after `path` (the first of equals, as argmax's); a forced
        token without reading the row."""
        _, forced, ids = self._mask(path)
        if forced is not None:
            return forced
        if len(ids) and row.device.type == "cpu" and row.dtype == torch.float32:  # a gather of the allowed ids
            return int(ids[row.numpy()[ids].argmax()])
        return int(self.masked(row, path).argmax())

    def masked(self, row: torch.Tensor, path: tuple) -> torch.Tensor:
        """Logits [V] with the tokens the grammar forbids after `path` at -inf (an empty mask: the row as it is)."""
        allowed = self._mask(path)[0]
        if not allowed.any():
            return row
        keep = torch.from_numpy(allowed).to(row.device)
        return row.masked_fill(~keep, float("-inf"))

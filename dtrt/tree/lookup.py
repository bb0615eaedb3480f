"""Prompt lookup: an index over one request's token stream (the prompt, then each token as it commits) that proposes
continuation chains of the stream's current suffix, copied from its earlier occurrences.

The index is an n-gram map: every n-gram of length 1..max_ngram that has a continuation, to the positions where it
ends, in order. Extending by a token registers the n-grams ending just before it (max_ngram dictionary entries);
a proposal looks up the stream's suffixes, longest first (at most max_ngram lookups), so neither grows with the
context."""

from math import ceil

MAX_NGRAM = 8
"""The longest suffix matched: beyond it, occurrences are not told apart by how much longer they match."""
SCAN = 8
"""Occurrences of the matched suffix read per alternative asked for, most recent first: a suffix that occurs
thousands of times with the same continuation costs no more than one that occurs a few times."""


class LookupIndex:
    def __init__(self, tokens=(), *, max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram {max_ngram}: must be >= 1")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens to the stream."""
        toks, ends, m = self.tokens, self.ends, self.max_ngram
        for t in tokens:
            toks.append(int(t))
            i = len(toks) - 2  # the n-grams ending here now have a continuation
            for n in range(1, min(m, i + 1) + 1):
                ends.setdefault(tuple(toks[i - n + 1 : i + 1]), []).append(i)

    def match(self) -> tuple[int, list[int]]:
        """(n, ends): the longest suffix of the stream, of length n <= max_ngram, that occurred earlier with a
        continuation, and the positions where those occurrences end, ascending (the list is the index's own: do not
        change it). (0, []) when no token of the stream's last occurred before."""
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks) - 1), 0, -1):
            ends = self.ends.get(tuple(toks[-n:]))
            if ends:
                return n, ends
        return 0, []

    def continuation(self, end: int, max_len: int) -> list[int]:
        """The `max_len` tokens after position `end` (< the last), read on into the copy itself where the stream
        ends: the suffix matched at `end` then repeats with period len(stream) - 1 - end, as it did so far."""
        seg = self.tokens[end + 1 : end + 1 + max_len]
        if len(seg) < max_len:
            seg = (seg * ceil(max_len / len(seg)))[:max_len]
        return seg

    def propose(self, *, max_len: int, n_alternatives: int = 1) -> list[list[int]]:
        """Up to `n_alternatives` distinct continuation chains of `max_len` tokens of the longest matching suffix,
        from its most recent occurrences first; [] when nothing matches."""
        if max_len < 1 or n_alternatives < 1:
            return []
        _, ends = self.match()
        chains: list[list[int]] = []
        for end in ends[: -SCAN * n_alternatives - 1 : -1]:
            chain = self.continuation(end, max_len)
            if chain not in chains:
                chains.append(chain)
                if len(chains) == n_alternatives:
                    break
        return chains

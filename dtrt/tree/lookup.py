"""Prompt lookup: an index over one request's token stream (the prompt, then each token as it commits) that proposes
continuation chains of the stream's current suffix, copied from its earlier occurrences.

The index is an n-gram map: every n-gram of length 1..max_ngram that has a continuation, to the positions where it
ends, in order; an n-gram's key is one integer, its tokens + 1 as KEY_BITS-bit digits, last token first. Extending
by a token registers the n-grams ending just before it (max_ngram dictionary entries); a proposal looks up the
stream's suffixes, shortest first, until one has not occurred (at most max_ngram lookups), and reads at most SCAN
occurrences per chain asked for: neither grows with the context (`benchmarks/lookup_index.py`).

The prefix cache keeps an index beside each snapshot, and a request that restores k positions forks it at k: the
fork reads the cached index's maps (ends before k - 1 only) and writes its own, so forking costs a copy of k
tokens, not the index's build."""

from bisect import bisect_right
from math import ceil

MAX_NGRAM = 8
"""The longest suffix matched: beyond it, occurrences are not told apart by how much longer they match."""
KEY_BITS = 32  # token ids are below 2**32 - 1
MAX_BASE = 8
"""Forks a chain of forks may read through before a fork is built afresh: a conversation forks once a turn."""
SCAN = 8
"""Occurrences of the matched suffix read per alternative asked for, most recent first: a suffix that occurs
thousands of times with the same continuation costs no more than one that occurs a few times."""


class LookupIndex:
    def __init__(self, tokens=(), *, max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram {max_ngram}: must be >= 1")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[int, int | list[int]] = {}  # n-gram -> where it ends: one, or several
        self.base: tuple[tuple[dict, int], ...] = ()  # (maps, last end read) of the indexes this one was forked from
        self.extend(tokens)

    def fork(self, n: int) -> "LookupIndex":
        """An index over this one's first n tokens that shares its maps, read only: extend the fork, never this one
        again (the prefix cache's indexes are frozen). A fork of a fork of ... past MAX_BASE is built afresh."""
        last = n - 2  # an n-gram ending at i has its continuation among the first n tokens when i <= n - 2
        base = tuple((ends, min(top, last)) for ends, top in self.base if min(top, last) >= 0)
        if last >= 0:
            base += ((self.ends, last),)
        if len(base) > MAX_BASE:
            return LookupIndex(self.tokens[:n], max_ngram=self.max_ngram)
        out = LookupIndex(max_ngram=self.max_ngram)
        out.tokens, out.base = self.tokens[:n], base
        return out

    def _ends(self, key: int) -> list[int] | None:
        """Where the n-gram `key` ends, ascending, over this index and its bases (None: nowhere)."""
        found = None
        for ends, last in (*self.base, (self.ends, None)):
            at = ends.get(key)
            if at is None:
                continue
            if type(at) is int:
                at = [at] if last is None or at <= last else []
            elif last is not None and at[-1] > last:
                at = at[: bisect_right(at, last)]
            if at:
                found = at if found is None else found + at
        return found

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens to the stream."""
        toks, ends, m = self.tokens, self.ends, self.max_ngram
        get = ends.get
        for t in tokens:
            toks.append(int(t))
            i = len(toks) - 2  # the n-grams ending here now have a continuation
            if i < 0:
                continue
            key = 0
            for u in toks[i : i - m if i >= m else None : -1]:
                key = key << KEY_BITS | (u + 1)
                at = get(key)
                if at is None:
                    ends[key] = i  # a plain int until it occurs again: 8K prompt tokens make 64K keys, and as
                elif type(at) is int:  # many lists would cost the garbage collector 4x the build
                    ends[key] = [at, i]
                else:
                    at.append(i)

    def match(self) -> tuple[int, list[int]]:
        """(n, ends): the longest suffix of the stream, of length n <= max_ngram, that occurred earlier with a
        continuation, and the positions where those occurrences end, ascending (the list is the index's own: do not
        change it). (0, []) when the stream's last token has not occurred before."""
        toks, found, key = self.tokens, (0, []), 0
        get = self._ends if self.base else self.ends.get
        for n, u in enumerate(toks[-1 : -min(self.max_ngram, len(toks) - 1) - 1 : -1], 1):
            key = key << KEY_BITS | (u + 1)
            ends = get(key)
            if ends is None:
                break
            found = n, [ends] if type(ends) is int else ends
        return found

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


def index_over(tokens, restored: LookupIndex | None = None) -> LookupIndex:
    """The index over `tokens`: `restored` (over their first positions, forked from the prefix cache's) extended over
    the rest, or built afresh."""
    if restored is None:
        return LookupIndex(tokens)
    restored.extend(tokens[len(restored) :])
    return restored

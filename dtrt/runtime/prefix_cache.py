"""The prefix cache: a request whose tokens begin with tokens an earlier request held (a previous turn of the same
conversation, a shared system prompt) starts from the state those tokens left: the target's K/V and the drafter's
context K/V of those positions, and the prompt-lookup index over them, restored, and only the rest prefilled.

Exact, bit for bit: a dense target's prompt is prefilled in calls that end at fixed boundaries, with the cache or
without it, and the drafter's context call by call alike. The boundaries are a function of the tokens before them:
right after every stop token (the end of a turn: a chat's system prompt, each message, each answer) and every CHUNK
positions after the last such end; the last call may end short. A snapshot keeps positions up to a boundary and a
prompt restores up to one, so every restored position holds what the same call, of the same shape over the same past,
computes in an uncached prefill, and the calls after it are the uncached prefill's own. A conversation's next turn
restores everything up to the end of the last answer, and a request behind a shared system prompt restores the
whole system turn. (A whole-prompt call and a split one differ in the last bits: torch's and ONNX Runtime's CPU
matmuls pick their kernel by the row count. Positions a verify call committed are never cached, for the same
reason: `remember` prefills a finished generation's tokens, in the same calls, while the pipeline is idle, so that
the conversation's next turn finds them.)

Entries are snapshots of the backend's state (`Backend.snapshot`), keyed by the tokens they hold; a prompt takes
the longest prefix any entry shares with it, up to a boundary, short of its last token (the first choice comes from
a real forward). Bounded by bytes (--prefix-cache-mb), least recently used first."""

import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from dtrt.tree.lookup import LookupIndex, index_over

DEFAULT_MB = 1024
"""--prefix-cache-mb's default: about 22K positions of SmolLM2-135M (fp32, 46 KB a position) or 7K of Qwen3-4B."""
CHUNK = 64
"""Prefill call (positions) of a target the cache can snapshot, between stop tokens. On SmolLM2-135M under ONNX
Runtime, one thread, a 2K-token prompt prefilled in calls of 64 took 0.7x the time of one call (its attention's
[N, N] work shrinks)."""


def boundaries(tokens, stops) -> list[int]:
    """Where a cacheable prefill's calls over `tokens` end, ascending: after each token in `stops` and CHUNK positions
    after the last end; the positions after the last boundary are one more call, which no snapshot keeps."""
    out, start = [], 0
    for i, t in enumerate(tokens):
        if t in stops or i + 1 - start == CHUNK:
            out.append(start := i + 1)
    return out


def kept(ends: list[int]) -> int:
    """The positions of a prefill with boundaries `ends` that a snapshot keeps: up to the last boundary."""
    return ends[-1] if ends else 0


def last_boundary(ends: list[int], n: int) -> int:
    """The last of the boundaries `ends` at or before position n (0: none)."""
    i = bisect.bisect_right(ends, n)
    return ends[i - 1] if i else 0


@dataclass
class Entry:
    tokens: np.ndarray  # int64: the positions the snapshot holds
    state: tuple  # Backend.snapshot
    nbytes: int
    seconds: float  # the prefill time these positions took (restored ones counted at what they first took)
    index: LookupIndex | None = None  # the prompt-lookup index over `tokens` (frozen), where the method has one


@dataclass
class Hit:
    tokens: int = 0  # positions restored
    saved_s: float = 0.0  # their prefill time minus the restore's
    index: LookupIndex | None = None  # the lookup index over those positions (a fork of the entry's), if it had one


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    saved_s: float = 0.0
    evictions: int = 0
    fills: int = 0  # remember() calls that prefilled generated tokens
    interrupted: int = 0  # remember() calls cut short by a waiting request (what they had prefilled is kept)


def state_bytes(state: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in state)


def shared(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class PrefixCache:
    limit_mb: int = DEFAULT_MB
    entries: OrderedDict = field(default_factory=OrderedDict)  # key: tokens' bytes; least recently used first
    used: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    owner: object = None
    """The generation (or remember) the backend's state belongs to now: a snapshot is taken only by its owner."""

    def find(self, tokens: list[int], room: int, ends: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and how much of it to restore: at most `room`
        positions, up to one of the boundaries `ends` of `tokens`; (None, 0) when none helps."""
        want = np.asarray(tokens, dtype=np.int64)
        best, best_n = None, 0
        for entry in self.entries.values():
            n = last_boundary(ends, min(shared(entry.tokens, want), room))
            if n > best_n:
                best, best_n = entry, n
        if best is not None:
            self.entries.move_to_end(best.tokens.tobytes())
        return best, best_n

    def store(self, tokens: list[int], state: tuple, seconds: float, index: LookupIndex | None = None):
        """Keep a snapshot of `tokens`' state (and their lookup index); entries it extends are dropped (it holds
        their positions), the least recently used go until it fits; one larger than the whole limit is not kept."""
        arr = np.asarray(tokens, dtype=np.int64)
        nbytes = state_bytes(state)
        if nbytes > self.limit_mb * 2**20:
            return
        for key, entry in list(self.entries.items()):
            if len(entry.tokens) <= len(arr) and shared(entry.tokens, arr) == len(entry.tokens):
                self._drop(key)
        while self.entries and self.used + nbytes > self.limit_mb * 2**20:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        self.entries[arr.tobytes()] = Entry(arr, state, nbytes, seconds, index)
        self.used += nbytes

    def _drop(self, key: bytes):
        self.used -= self.entries.pop(key).nbytes

    def snapshot(self) -> dict:
        """What /metrics reports of the cache."""
        s = self.stats
        return {
            "lookups": s.lookups,
            "hits": s.hits,
            "hit_tokens": s.hit_tokens,
            "saved_s": s.saved_s,
            "evictions": s.evictions,
            "fills": s.fills,
            "interrupted": s.interrupted,
            "entries": len(self.entries),
            "bytes": self.used,
            "limit_bytes": self.limit_mb * 2**20,
        }


def restore(backend, cache: PrefixCache | None, tokens: list[int], room: int, ends, count=True) -> tuple[Hit, float]:
    """After `backend.reset`: the longest cached prefix of `tokens` (at most `room` positions, up to one of its
    boundaries `ends`) restored; the hit and the prefill seconds of the restored positions (what they first took).
    `count`: a request's lookup (the stats)."""
    if cache is None:
        return Hit(), 0.0
    t0 = time.perf_counter()
    cache.stats.lookups += count
    entry, n = cache.find(tokens, room, ends)
    if entry is None:
        return Hit(), 0.0
    backend.restore(entry.state, n)
    index = entry.index.fork(n) if entry.index is not None else None
    took = entry.seconds * n / len(entry.tokens)
    hit = Hit(n, took - (time.perf_counter() - t0), index)
    if count:
        cache.stats.hits += 1
        cache.stats.hit_tokens += n
        cache.stats.saved_s += hit.saved_s
    return hit, took


def prefill(backend, tokens: list[int], start: int, drafts: bool, ends: list[int] | None, stop_early=None):
    """Positions start..len(tokens)-1 prefilled after the `start` restored ones (a boundary), with the drafter's
    context (`drafts`), in calls that end at the boundaries `ends` of `tokens` (None: one call). Returns the last
    call's logits and the positions prefilled; `stop_early()` turning true between calls ends it there."""
    calls = [b for b in ends or () if b > start]
    if not calls or calls[-1] < len(tokens):
        calls.append(len(tokens))
    a, logits = start, None
    for b in calls:
        if a > start and stop_early is not None and stop_early():
            break
        n = b - a
        ids, positions, mask = torch.tensor(tokens[a:b]), torch.arange(a, b), torch.ones(n, n).tril().bool()
        logits, hidden = backend.target_forward(ids, positions, mask)
        backend.commit(torch.arange(n))
        if drafts:
            backend.draft_context(hidden, positions)
        a = b
    return logits, a


def cacheable(backend) -> bool:
    """Whether the cache can snapshot the backend's state (a hybrid target's recurrent state: no), so its prefills
    are split at the boundaries."""
    return backend.snapshot_refusal() is None


def remember(backend, cache: PrefixCache | None, tokens: list[int], drafts: bool, stops, lookup=False, stop_early=None):
    """Prefill `tokens` (a request's prompt and its generated tokens) from their longest cached prefix and keep the
    snapshot (with the lookup index over them where `lookup`): the next turn of the conversation restores them.
    Nothing where the cache holds them all. `stop_early()` turning true (a request waiting) ends the prefill at the
    next boundary and keeps what it reached."""
    ends = boundaries(tokens, stops)
    keep = kept(ends)
    if cache is None or keep == 0:
        return
    cache.owner = object()
    backend.reset(keep)
    hit, took = restore(backend, cache, tokens, keep, ends, count=False)
    if hit.tokens >= keep:
        return
    t0 = time.perf_counter()
    _, reached = prefill(backend, tokens[:keep], hit.tokens, drafts, ends, stop_early)
    cache.stats.fills += 1
    cache.stats.interrupted += reached < keep
    index = index_over(tokens[:reached], hit.index) if lookup else None
    cache.store(tokens[:reached], backend.snapshot(reached), took + time.perf_counter() - t0, index)

"""The prefix cache: a request whose tokens begin with tokens an earlier request held (a previous turn of the same
conversation, a shared system prompt) starts from the state those tokens left: the target's K/V and the drafter's
context K/V of those positions, restored, and only the rest prefilled.

Exact, bit for bit: a dense target's prompt is prefilled in chunks at fixed boundaries (positions 0, CHUNK,
2*CHUNK, ...; the last chunk partial), with the cache or without it, and the drafter's context chunk by chunk
alike. A snapshot keeps whole chunks only and a prompt restores whole chunks only, so every restored position holds
what the same call, of the same shape over the same past, computes in an uncached prefill, and the calls after it
are the uncached prefill's own. (A whole-prompt call and a split one differ in the last bits: torch's CPU matmuls
pick their kernel by the row count. Positions a verify call committed are never cached, for the same reason:
`remember` prefills a finished generation's tokens, in the same chunks, while the pipeline is idle, so that the
conversation's next turn finds them.)

Entries are snapshots of the backend's state (`Backend.snapshot`), keyed by the tokens they hold; a prompt takes
the longest prefix any entry shares with it, in whole chunks, short of its last token (the first choice comes from
a real forward). Bounded by bytes (--prefix-cache-mb), least recently used first."""

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

DEFAULT_MB = 1024
"""--prefix-cache-mb's default: about 22K positions of SmolLM2-135M (fp32, 46 KB a position) or 7K of Qwen3-4B."""
CHUNK = 64
"""Prefill chunk (positions) of a target the cache can snapshot. On SmolLM2-135M under ONNX Runtime, one thread, a
2K-token prompt prefilled in chunks of 64 took 0.7x the time of one call (its attention's [N, N] work shrinks)."""


@dataclass
class Entry:
    tokens: np.ndarray  # int64: the positions the snapshot holds
    state: tuple  # Backend.snapshot
    nbytes: int
    seconds: float  # the prefill time these positions took (restored ones counted at what they first took)


@dataclass
class Hit:
    tokens: int = 0  # positions restored
    saved_s: float = 0.0  # their prefill time minus the restore's


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    saved_s: float = 0.0
    evictions: int = 0
    fills: int = 0  # remember() calls that prefilled generated tokens


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

    def find(self, tokens: list[int], room: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and how much of it to restore: at most `room`
        positions, whole chunks; (None, 0) when none helps."""
        want = np.asarray(tokens, dtype=np.int64)
        best, best_n = None, 0
        for entry in self.entries.values():
            n = min(shared(entry.tokens, want), room) // CHUNK * CHUNK
            if n > best_n:
                best, best_n = entry, n
        if best is not None:
            self.entries.move_to_end(best.tokens.tobytes())
        return best, best_n

    def store(self, tokens: list[int], state: tuple, seconds: float):
        """Keep a snapshot of `tokens`' state; entries it extends are dropped (it holds their positions), the least
        recently used go until it fits; one larger than the whole limit is not kept."""
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
        self.entries[arr.tobytes()] = Entry(arr, state, nbytes, seconds)
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
            "entries": len(self.entries),
            "bytes": self.used,
            "limit_bytes": self.limit_mb * 2**20,
        }


def restore(backend, cache: PrefixCache | None, tokens: list[int], room: int, count=True) -> tuple[Hit, float]:
    """After `backend.reset`: the longest cached prefix of `tokens` (at most `room` positions) restored; the hit and
    the prefill seconds of the restored positions (what they first took). `count`: a request's lookup (the stats)."""
    if cache is None:
        return Hit(), 0.0
    t0 = time.perf_counter()
    cache.stats.lookups += count
    entry, n = cache.find(tokens, room)
    if entry is None:
        return Hit(), 0.0
    backend.restore(entry.state, n)
    took = entry.seconds * n / len(entry.tokens)
    hit = Hit(n, took - (time.perf_counter() - t0))
    if count:
        cache.stats.hits += 1
        cache.stats.hit_tokens += n
        cache.stats.saved_s += hit.saved_s
    return hit, took


def prefill(backend, tokens: list[int], start: int, drafts: bool, chunk: int | None):
    """Positions start..len(tokens)-1 prefilled after the `start` restored ones, with the drafter's context
    (`drafts`), in calls that end at the multiples of `chunk` (None: one call); the last call's logits."""
    step = chunk or len(tokens)
    for a in range(start, len(tokens), step):
        b = min(len(tokens), a + step)
        n = b - a
        ids, positions, mask = torch.tensor(tokens[a:b]), torch.arange(a, b), torch.ones(n, n).tril().bool()
        logits, hidden = backend.target_forward(ids, positions, mask)
        backend.commit(torch.arange(n))
        if drafts:
            backend.draft_context(hidden, positions)
    return logits


def chunk_for(backend) -> int | None:
    """The prefill chunk of a backend the cache can snapshot; None: one call (a hybrid target)."""
    return CHUNK if backend.snapshot_refusal() is None else None


def kept(n: int) -> int:
    """The positions of an n-token prefill a snapshot keeps: whole chunks."""
    return n // CHUNK * CHUNK


def remember(backend, cache: PrefixCache | None, tokens: list[int], drafts: bool):
    """Prefill `tokens` (a request's prompt and its generated tokens) from their longest cached prefix and keep the
    snapshot: the next turn of the conversation restores them. Nothing where the cache holds them all."""
    keep = kept(len(tokens))
    if cache is None or keep == 0:
        return
    backend.reset(keep)
    hit, took = restore(backend, cache, tokens, keep, count=False)
    if hit.tokens >= keep:
        return
    t0 = time.perf_counter()
    prefill(backend, tokens[:keep], hit.tokens, drafts, CHUNK)
    cache.stats.fills += 1
    cache.store(tokens[:keep], backend.snapshot(keep), took + time.perf_counter() - t0)

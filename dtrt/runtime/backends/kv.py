"""K/V caches of the export backends.

TargetKV holds the target's K/V as [layers, kv_heads, capacity, head_dim] and appends in place: the target stage
takes the whole buffer and the past length (past_positions, DESIGN.md section 2), and slices each layer's past
itself, so no append moves what is already stored. (A dense [.., length, ..] cache re-spaced every (layer, head)
row on every append: a copy of the whole past per token, as costly as a quarter of a small target's decode step
at a past of a few hundred positions, and growing with it.)

The drafter block stages read their cache dense, [layers, kv_heads, length, head_dim] each for K and V, stored as
one flat buffer so a stage reads it as a view of its first layers*kv_heads*length*head_dim elements. PackedKV (host
memory) re-spaces the (layer, head) rows in place on every append: one memmove per row, last row first so no row
overwrites one not yet moved. DevicePackedKV (device memory, where overlapping moves are not a primitive) writes the
re-spaced entries into a second buffer and swaps the two. A drafter has a layer or two: its rows are few.
"""

import ctypes

import torch

from dtrt.models.kv_buffer import KVBuffer, appended_end


def past_feeds(past_k, past_v, past) -> dict:
    """The target stage's cache inputs (DESIGN.md section 2): K/V buffers [layers, kv_heads, capacity, head_dim]
    of which the first `past` positions are the past (`past`: their count, or their positions 0..n-1 as a tensor);
    every caller of the target stage builds them here."""
    positions = past if isinstance(past, torch.Tensor) else torch.arange(past)
    return {"past_k": past_k, "past_v": past_v, "past_positions": positions}


class TargetKV(KVBuffer):
    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cpu"):
        super().__init__(layers, heads, head_dim, capacity, dtype, device)
        self._positions = torch.arange(capacity, device=device)

    def feeds(self, length: int | None = None) -> dict[str, torch.Tensor]:
        """The target stage's cache inputs for a past of `length` positions (default: the stored ones; a longer
        one reads stale entries, as the cost probes do)."""
        n = self.length if length is None else length
        return past_feeds(self.k, self.v, self._positions[:n])


class PackedKV:
    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cpu"):
        self.lead, self.rows, self.head_dim, self.capacity = (layers, heads), layers * heads, head_dim, capacity
        size = self.rows * capacity * head_dim
        self.k, self.v = (torch.zeros(size, dtype=dtype, device=device) for _ in range(2))
        self.length = 0

    def view(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [layers, kv_heads, length, head_dim] views; a length beyond the stored one reads stale rows."""
        n = self.length if length is None else length
        size = self.rows * n * self.head_dim
        shape = (*self.lead, n, self.head_dim)
        return self.k[:size].view(shape), self.v[:size].view(shape)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add k, v [layers, kv_heads, n, head_dim] after the stored entries."""
        p, n, hd = self.length, k.shape[2], self.head_dim
        q = appended_end(self.length, n, self.capacity)
        for buf, new in ((self.k, k), (self.v, v)):
            if p:
                row, base, item = p * hd * buf.element_size(), buf.data_ptr(), buf.element_size()
                for r in range(self.rows - 1, 0, -1):
                    ctypes.memmove(base + r * q * hd * item, base + r * row, row)
            buf[: self.rows * q * hd].view(self.rows, q, hd)[:, p:] = new.reshape(self.rows, n, hd)
        self.length = q

    def reset(self):
        self.length = 0


class DevicePackedKV(PackedKV):
    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cuda"):
        super().__init__(layers, heads, head_dim, capacity, dtype, device)
        self._spare = [torch.empty_like(self.k), torch.empty_like(self.v)]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        p, n, hd = self.length, k.shape[2], self.head_dim
        q = appended_end(self.length, n, self.capacity)
        for i, (buf, new) in enumerate(((self.k, k), (self.v, v))):
            dst = self._spare[i][: self.rows * q * hd].view(self.rows, q, hd)
            if p:
                dst[:, :p].copy_(buf[: self.rows * p * hd].view(self.rows, p, hd))
            dst[:, p:].copy_(new.reshape(self.rows, n, hd))
        (self.k, self._spare[0]), (self.v, self._spare[1]) = (self._spare[0], self.k), (self._spare[1], self.v)
        self.length = q


def kv_cache_for(device: torch.device) -> type[PackedKV]:
    return PackedKV if device.type == "cpu" else DevicePackedKV

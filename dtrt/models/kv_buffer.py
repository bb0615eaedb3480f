"""A K/V buffer of committed positions, appended in place: [layers, kv_heads, capacity, head_dim] for K and for V,
the first `length` positions stored. The torch backend keeps its drafter's context in one (dtrt.models.drafter's
DraftCache), the export backends their target's (dtrt.runtime.backends.kv.TargetKV): an append writes after the
stored positions and moves none of them, and a fixed-shape reader (a CUDA graph, a stage that takes the whole
buffer with the past's length) sees the same addresses on every call."""

import torch


def appended_end(length: int, n: int, capacity: int) -> int:
    """Where `n` entries appended after `length` stored ones end; an overflow of `capacity` is an error."""
    if length + n > capacity:
        raise RuntimeError(f"KV cache overflow: {length + n} > capacity {capacity}")
    return length + n


class KVBuffer:
    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype=torch.float32, device="cpu"):
        shape = (layers, heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add k, v [layers, kv_heads, n, head_dim] after the stored entries."""
        p, q = self.length, appended_end(self.length, k.shape[2], self.capacity)
        self.k[:, :, p:q] = k
        self.v[:, :, p:q] = v
        self.length = q

    def append_layers(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        """Add each layer's (k, v) [kv_heads, n, head_dim] after the stored entries."""
        p, q = self.length, appended_end(self.length, kv[0][0].shape[-2], self.capacity)
        for i, (k, v) in enumerate(kv):
            self.k[i, :, p:q] = k
            self.v[i, :, p:q] = v
        self.length = q

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's stored K and V, [kv_heads, length, head_dim] views."""
        return self.k[i, :, : self.length], self.v[i, :, : self.length]

    def reset(self):
        self.length = 0

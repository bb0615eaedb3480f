"""K/V caches of the export backends.

TargetKV holds the target's K/V as [layers, kv_heads, capacity, head_dim] and appends in place: the target stage
takes the whole buffer and the past length (past_positions, DESIGN.md section 2), and slices each layer's past
itself, so no append moves what is already stored. (A dense [.., length, ..] cache re-spaced every (layer, head)
row on every append: a copy of the whole past per token, as costly as a quarter of a small target's decode step
at a past of a few hundred positions, and growing with it.)

The drafter block stages (export layout 16 on) read their context cache position-major, one input per draft layer
and per K and V: [length, kv_heads, head_dim] (dtrt.models.drafter.block_cache_inputs). LayerKV stores each as the
first `length` positions of a [capacity, kv_heads, head_dim] buffer, so a layer's input is a contiguous view, an
append writes after the stored positions and moves none of them, on the host and on a device alike. (Before it, one
dense [layers, kv_heads, length, head_dim] cache re-spaced its (layer, head) rows on every append, a memmove of the
past per row, and the stage split it by layer, a copy of all of it on every call: SmolLM2's block lost 0.07 ms a
call to the split at a past of 300 and 0.79 ms at 3,000.)
"""

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


class LayerKV:
    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cpu"):
        shape = (layers, capacity, heads, head_dim)
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
        self.capacity, self.length = capacity, 0

    def view(self, length: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per draft layer, (k, v) [length, kv_heads, head_dim] contiguous views; a length beyond the stored one reads
        stale positions."""
        n = self.length if length is None else length
        return [k[:n] for k in self.k], [v[:n] for v in self.v]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add k, v [layers, kv_heads, n, head_dim] (a context stage's ctx_k/ctx_v) after the stored entries."""
        p = self.length
        q = appended_end(p, k.shape[2], self.capacity)
        self.k[:, p:q] = k.transpose(1, 2)
        self.v[:, p:q] = v.transpose(1, 2)
        self.length = q

    def reset(self):
        self.length = 0

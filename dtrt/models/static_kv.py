"""The target's K/V with static shapes: one buffer per K and V allocated once for the context limit, plus a tail of
`width` slots where a fixed-width verify writes its new tokens. A captured step (torch.compile, a CUDA graph) sees
the same addresses and shapes on every call; the committed length is a device tensor, so no host value enters it.

Two modes share the buffer. Growing (`static` False: the prefill, any call of another width) is KVCache's: the new
tokens are written after the past and the keys are the past and them. Static (`static` True): the new tokens are
written into the tail, the keys are the whole buffer (capacity + width columns) and the past's columns are those
below `length`; `commit_order` moves the accepted tail entries after the past and advances `length` on the device.
A static call's attention (`attend`) is dtrt.models.layers.committed_attention: on CUDA a split kernel that reads
only the committed columns.
"""

import torch

from dtrt.models.config import TargetConfig
from dtrt.models.layers import attention, committed_attention
from dtrt.models.target import KVCache


class StaticKVCache(KVCache):
    def __init__(self, cfg: TargetConfig, capacity: int, width: int, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, capacity + width, dtype, device)
        self.capacity, self.width = capacity, width
        self.length = torch.zeros((), dtype=torch.long, device=device)  # committed positions, on the device
        self.static = False

    def past_mask(self, mask):
        if not self.static:
            return super().past_mask(mask)
        columns = torch.arange(self.capacity, device=mask.device)
        return (columns < self.length).expand(*mask.shape[:-1], self.capacity)

    def update(self, layer: int, k, v):
        if not self.static:
            return super().update(layer, k, v)
        end = self.capacity + k.shape[-2]
        self.k[layer, :, self.capacity : end] = k
        self.v[layer, :, self.capacity : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def attend(self, q, k, v, mask):
        """A layer's attention over update's keys (mask [N, keys]: the past's columns, then the tree's). A static
        call's is committed_attention's: on CUDA it reads the committed length and the tree's [N, N] corner only."""
        if not self.static:
            return attention(q, k, v, mask)
        c = self.capacity
        return committed_attention(q, k[..., :c, :], v[..., :c, :], self.length, k[..., c:, :], v[..., c:, :],
                                   mask[..., c:])  # fmt: skip

    def commit(self, accepted):
        """A growing call's commit (host indices); the device length follows the host's past."""
        super().commit(accepted)
        self.length.fill_(self.past)

    def commit_order(self, order: torch.Tensor, count: torch.Tensor):
        """After a static call: the tail entries `order` [W] (the accepted ones first, ascending) written at the
        committed length, `count` of them committed. The other W - count land past the new length, unread."""
        w = order.shape[0]
        slots = self.length + torch.arange(w, device=order.device)
        tail = self.capacity + order
        self.k.index_copy_(2, slots, self.k.index_select(2, tail))
        self.v.index_copy_(2, slots, self.v.index_select(2, tail))
        self.length.add_(count)

    def reset(self):
        super().reset()
        self.length.zero_()

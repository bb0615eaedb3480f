"""The target's K/V with static shapes: one buffer per K and V allocated once for the context limit, plus a tail of
`width` slots where a fixed-width verify writes its new tokens. A captured step (torch.compile, a CUDA graph) sees
the same addresses and shapes on every call; the committed length is a device tensor, so no host value enters it.

Two modes share the buffer. Growing (`static` False: the prefill, any call of another width) is KVCache's: the new
tokens are written after the past and the keys are the past and them. Static (`static` True): the new tokens are
written into the tail, and every row sees the committed columns (those below `length`) and its tree ancestors;
`commit_order` moves the accepted tail entries after the past and advances `length` on the device. A static call's
layer writes its new K/V and attends in one custom op (`static_attend`): on CUDA a split kernel that reads only the
committed columns.
"""

import torch

from dtrt.models.config import TargetConfig
from dtrt.models.layers import attention, committed
from dtrt.models.target import KVCache


@torch.library.custom_op("dtrt::static_attend", mutates_args=("k_buf", "v_buf"))
def static_attend(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    length: torch.Tensor,
    tree: torch.Tensor,
    capacity: int,
) -> torch.Tensor:
    """A static call's layer: the N new tokens' K/V [KVH, N, hd] written into the layer's buffer [KVH, capacity +
    width, hd] at the tail (from `capacity`), then their attention over the committed past and themselves
    (dtrt.models.layers.committed). One op that declares what it writes: torch.compile hands it the cache's layer
    as it lies and fuses everything around it, with no copy of the buffer (a write inside the compiled graph
    would be functionalized into one)."""
    n = k_new.shape[-2]
    k_buf[:, capacity : capacity + n] = k_new
    v_buf[:, capacity : capacity + n] = v_new
    past_k, past_v = k_buf[:, :capacity], v_buf[:, :capacity]
    return committed(q, past_k, past_v, length, k_buf[:, capacity : capacity + n], v_buf[:, capacity : capacity + n],
                     tree)  # fmt: skip


@static_attend.register_fake
def _(q, k_new, v_new, k_buf, v_buf, length, tree, capacity):
    return q.new_empty(q.shape)


class StaticKVCache(KVCache):
    def __init__(self, cfg: TargetConfig, capacity: int, width: int, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, capacity + width, dtype, device)
        self.capacity, self.width = capacity, width
        self.length = torch.zeros((), dtype=torch.long, device=device)  # committed positions, on the device
        self.static = False

    def past_mask(self, mask):
        """Static: none (static_attend sees the committed length itself), so the layers' mask is the tree's."""
        if not self.static:
            return super().past_mask(mask)
        return mask[..., :0]

    def update(self, layer: int, k, v):
        """Growing: KVCache's. Static: nothing yet (attend writes the new K/V into the tail), the new K/V as given."""
        if not self.static:
            return super().update(layer, k, v)
        return k, v

    def attend(self, layer: int, q, k, v, mask):
        """A layer's attention: growing, over update's keys under `mask`; static, `static_attend` of the new K/V
        under the tree's mask [N, N]."""
        if not self.static:
            return attention(q, k, v, mask)
        return static_attend(q, k, v, self.k[layer], self.v[layer], self.length, mask, self.capacity)

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

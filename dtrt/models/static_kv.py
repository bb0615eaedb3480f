"""The target's K/V with static shapes: one buffer per K and V allocated once for the context limit, plus a tail of
`width` slots where a fixed-width verify writes its new tokens. A captured step (torch.compile, a CUDA graph) sees
the same addresses and shapes on every call; the committed length is a device tensor, so no host value enters it.

Two modes share the buffer. Growing (`static` False: the prefill, any call of another width) is KVCache's: the new
tokens are written after the past and the keys are the past and them. Static (`static` True): the new tokens are
written into the tail, and every row sees the committed columns (those below `length`) and its tree ancestors;
`commit_order` moves the accepted tail entries after the past and advances `length` on the device. A static call's
layer (`run_layer`) writes its new K/V and attends in one custom op (`static_attend`: on CUDA a split kernel that
reads only the committed columns), between the layer's parts, compiled by torch.compile where the cache says so.
"""

import functools

import torch

from dtrt.errors import BackendFault, first_line
from dtrt.models.config import TargetConfig
from dtrt.models.layers import committed
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


def layer_qkv(layer, x, cos, sin):
    return layer.qkv(x, cos, sin)


def layer_finish(layer, x, a):
    return layer.finish(x, a)


@functools.cache
def compiled_parts() -> tuple:
    """A decoder layer's parts before and after attention through torch.compile (Inductor), one compile for every
    layer of a target (the layer's weights are inputs) and every width but 1 (the width marked dynamic)."""

    def compiled(fn):
        whole = torch.compile(fn, fullgraph=True)

        def call(*args):
            with torch._dynamo.config.patch(recompile_limit=64):  # a process may hold several targets' shapes
                try:
                    return whole(*args)
                except torch._dynamo.exc.BackendCompilerFailed as e:  # Inductor's errors too (a missing compiler)
                    raise BackendFault(
                        f"--compile: torch.compile could not compile the decoder layers on this machine "
                        f"({first_line(e)}); run with --no-compile (the captured graphs of the eager ops)"
                    ) from e

        return call

    return compiled(layer_qkv), compiled(layer_finish)


class StaticKVCache(KVCache):
    def __init__(
        self, cfg: TargetConfig, capacity: int, width: int, dtype=torch.float32, device="cpu", compiled: bool = False
    ):
        """compiled: a static call's layers run their parts before and after attention compiled (compiled_parts)."""
        super().__init__(cfg, capacity + width, dtype, device)
        self.capacity, self.width, self.compiled = capacity, width, compiled
        self.length = torch.zeros((), dtype=torch.long, device=device)  # committed positions, on the device
        self.static = False

    def past_mask(self, mask):
        """Static: none (static_attend sees the committed length itself), so the layers' mask is the tree's."""
        if not self.static:
            return super().past_mask(mask)
        return mask[..., :0]

    def run_layer(self, layer, x, cos, sin, mask, i: int):
        """Decoder layer i on x [N, H]. Growing: as the layer runs over any cache. Static: its new K/V written into
        the tail and attended by `static_attend` (mask: the tree's [N, N]) between the layer's parts, which run
        compiled when the cache is (the write and the attention stay outside the compiled code: a compiled write
        into the buffer, at a layer index that varies, is what compilers get wrong or copy)."""
        if not self.static:
            return layer(x, cos, sin, mask, self, i)
        qkv, finish = compiled_parts() if self.compiled else (layer_qkv, layer_finish)
        if self.compiled:  # the width, in every input that has it
            for t in (x, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        q, k, v = qkv(layer, x, cos, sin)
        a = static_attend(q, k, v, self.k[i], self.v[i], self.length, mask, self.capacity)
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(a, 1)
        return finish(layer, x, a)

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

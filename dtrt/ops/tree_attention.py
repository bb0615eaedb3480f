"""TreeAttention: attention of N new tokens over past + new keys under an explicit mask, with GQA.

q [H, N, hd], k/v [KVH, M, hd] (M = past + new; H a multiple of KVH), mask bool [N, M] (True = attend),
out [H, N, hd]. The tree mask makes a node see the whole past, its ancestors and itself.
"""

import torch
import torch.nn.functional as F

from dtrt.ops.base import emit
from dtrt.ops.kernels import kernel


def tree_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    groups = q.shape[-3] // k.shape[-3]
    if q.dim() == 4 and not torch.onnx.is_in_onnx_export():  # batched (training, data): K/V heads read in place
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask.unsqueeze(-3), enable_gqa=groups > 1
        )
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    if mask is not None:
        mask = mask.unsqueeze(-3)
    if q.dim() == 3:  # SDPA exports only 4-D inputs
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


torch.library.custom_op("dtrt::tree_attention", mutates_args=())(tree_attention_ref)


def tree_attention(q, k, v, mask=None):
    """The models' entry point: a `dtrt::TreeAttention` node during ONNX export (batch-free 3-D inputs with a
    mask); eagerly the Triton kernel or the reference (dtrt.ops.kernels; the reference also serves batched
    training and mask-free calls)."""
    if mask is not None and q.dim() == 3:
        if torch.onnx.is_in_onnx_export():
            return emit("TreeAttention", (q, k, v, mask), (q.dtype,), (q.shape,))
        if (run := kernel("tree_attention", q, k, v)) is not None:
            return run(q, k, v, mask)
    return tree_attention_ref(q, k, v, mask)


# The ordered attention: placement-invariant TreeAttention, for targets whose layers quantize their activations
# (`dtrt export --quant`): there a last-bit difference in an attention output moves int8 roundings and grows to
# whole logits, so a tree's verify row must equal, bit for bit, the row plain decoding computes for the same token.
# The plain
# formulation sums each row's softmax and values in column order, and a tree node's ancestors sit at other
# columns (interleaved with masked siblings) than in plain decoding (right after the past), which changes the
# rounding. Here each row's sums run over the same sequence in both: the past up to ORDER_ALIGN-aligned position b0
# in one product (the same columns for every row of every call that shares b0), then the rest of the past and the
# row's attended new columns gathered to the front in index order (ancestors by depth, then the node) and the masked
# ones (exact zeros) after them. The runtime keeps a tree inside the aligned block of its past (Backend.max_depth),
# so plain decoding of the same tokens shares b0. Softmax's sum is not Softmax's (ORT's kernel sums in SIMD lanes,
# which depend on the column): the head's weights are summed by a ReduceSum over its columns (the same columns in
# plain decoding and in a tree) and the tail's in its product, through a ones column appended to its gathered values.
# The head reads the values where they lie (a ones column appended to all of them, as layout 6 had it, copied every
# layer's past once more per call; a product of the head's weights with a ones column of its own was not exact on
# SmolLM2: ONNX Runtime's one-column product differs with the number of rows, caught by the order check).
# The past is never joined with the new keys and values (layout 8): the scores of the past keys and of the new ones
# are two products side by side, the head's values are sliced straight from the layer's cache (the export's
# past_v input) and the tail's from the cache and the new values. Joining them copied every layer's whole past
# twice more per call (the joined keys, the joined values, then the head's values out of them).
# Calls of more than ORDER_ROWS rows (prefills) share one path with the others, as plain and speculative decoding
# share their prefill: their plan puts b0 at the last column, so the head is the whole row (the past's columns and
# the new ones, hnew = N, two products) and the tail is empty. One path for every call keeps the layers free of an
# If, whose subgraph costs each layer more than its nodes (6% of an int4 SmolLM2 call).
# It comes in two parts with the arithmetic in this order: what depends only on the mask and the shapes (the grouped
# mask, the tail's gather order, the shapes of every reshape) is computed once per call by TreeAttentionOrderPlan,
# and each layer's TreeAttentionPlanned reads it. Every layer of a target shares its mask, so the per-layer part is
# about half the nodes of a self-contained op, and at these sizes the nodes cost more than the arithmetic.
ORDER_ALIGN = 128
ORDER_ROWS = 64

ORDER_PLAN = (
    "mask_g",  # bool [groups * N, M]: the mask per query row of a K/V head
    "qg_shape",  # [KVH, groups * N, hd]
    "out_shape",  # [H, N, hd]
    "ones_tail",  # [KVH, T, 1]: the tail values' appended column that sums the weights
    "b0",  # the end of the head product: ORDER_ALIGN-aligned; the last column when N > ORDER_ROWS (prefills)
    "b0p",  # [min(b0, P)]: the head's columns in the past (read from the cache)
    "hnew",  # [b0 - b0p]: the head's new columns (N for a prefill, 0 for every other call)
    "head_end",  # [1, b0p]: the head's end in a [layer, position] slice of the cache, before the layer's offset
    "tail_start",  # [0, b0p]: the tail's past, likewise (it ends at [1, P], tail_end)
    "tail_end",
    "order",  # [N, T]: each row's tail columns, attended first, in index order (T = M - b0)
    "order_g",  # [KVH, groups * N, T]
    "tail_shape",  # [KVH, groups, N, T]
    "acc_shape",  # [KVH, groups * N, hd + 1]
    "hd",  # [hd]
    "hd1",  # [hd + 1]
)

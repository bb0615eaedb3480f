"""TreeAttention: attention of N new tokens over past + new keys under an explicit mask, with GQA.

q [H, N, hd], k/v [KVH, M, hd] (M = past + new; H a multiple of KVH), mask bool [N, M] (True = attend),
out [H, N, hd]. The tree mask makes a node see the whole past, its ancestors and itself.
"""

import onnxscript
import torch
import torch.nn.functional as F
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.base import OPSET, emit, register_function
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


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttention(q: FLOAT, k: FLOAT, v: FLOAT, mask: BOOL) -> FLOAT:
    heads = op.Shape(q, start=0, end=1)
    kv_heads = op.Shape(k, start=0, end=1)
    groups = op.Div(heads, kv_heads)
    expanded = op.Concat(kv_heads, groups, op.Shape(k, start=1), axis=0)
    merged = op.Concat(heads, op.Shape(k, start=1), axis=0)
    kk = op.Reshape(op.Expand(op.Unsqueeze(k, [1]), expanded), merged)
    vv = op.Reshape(op.Expand(op.Unsqueeze(v, [1]), expanded), merged)
    head_dim = op.CastLike(op.Shape(q, start=2, end=3), q)
    scale = op.Div(op.CastLike(op.Constant(value_float=1.0), q), op.Sqrt(head_dim))
    scores = op.Mul(op.MatMul(q, op.Transpose(kk, perm=[0, 2, 1])), scale)
    scores = op.Where(op.Unsqueeze(mask, [0]), scores, op.CastLike(op.Constant(value_float=-1e30), q))
    out = op.MatMul(op.Softmax(scores, axis=-1), vv)
    return out


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
# so plain decoding of the same tokens shares b0. Softmax's sum runs in the same products (an appended ones column
# of the values): ORT's Softmax kernel sums in SIMD lanes, which depend on the column. Calls of more than ORDER_ROWS
# rows (prefills) take one product, as plain and speculative decoding share their prefill: their plan puts b0 at
# the last column, so the head product is all of it and the tail is empty. One path for every call keeps the layers
# free of an If, whose subgraph costs each layer more than its nodes (6% of an int4 SmolLM2 call).
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
    "ones",  # [KVH, M, 1]: the values' appended column that sums the weights
    "scale",  # 1 / sqrt(hd)
    "b0",  # the end of the head product: ORDER_ALIGN-aligned; the last column when N > ORDER_ROWS (prefills)
    "order",  # [N, T]: each row's tail columns, attended first, in index order (T = M - b0)
    "order_g",  # [KVH, groups * N, T]
    "tail_shape",  # [KVH, groups, N, T]
    "acc_shape",  # [KVH, groups * N, hd + 1]
    "hd",  # [hd]
    "hd1",  # [hd + 1]
)


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttentionOrderPlan(q: FLOAT, k: FLOAT, mask: BOOL):
    heads = op.Shape(q, start=0, end=1)
    n = op.Shape(q, start=1, end=2)
    hd = op.Shape(q, start=2, end=3)
    kv_heads = op.Shape(k, start=0, end=1)
    m = op.Shape(k, start=1, end=2)
    groups = op.Div(heads, kv_heads)
    rows = op.Mul(groups, n)
    one = op.Constant(value_ints=[1])
    qg_shape = op.Concat(kv_heads, rows, hd, axis=0)
    out_shape = op.Concat(heads, n, hd, axis=0)
    scale = op.Div(op.CastLike(op.Constant(value_float=1.0), q), op.Sqrt(op.CastLike(hd, q)))
    mask_g = op.Reshape(op.Expand(op.Unsqueeze(mask, [0]), op.Concat(groups, n, m, axis=0)), op.Concat(rows, m, axis=0))
    ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), k), op.Concat(kv_heads, m, one, axis=0))
    hd1 = op.Add(hd, one)
    acc_shape = op.Concat(kv_heads, rows, hd1, axis=0)
    short = op.Squeeze(op.LessOrEqual(n, op.Constant(value_ints=[ORDER_ROWS])))
    if short:
        align = op.Constant(value_ints=[ORDER_ALIGN])
        b0 = op.Mul(op.Div(op.Sub(m, n), align), align)
    else:
        b0 = m
    t = op.Sub(m, b0)
    tail_mask = op.Slice(mask, b0, m, one)  # [N, T]
    j = op.Cast(op.Range(op.Constant(value_int=0), op.Squeeze(t), op.Constant(value_int=1)), to=1)
    tf = op.Cast(t, to=1)
    key = op.Where(tail_mask, op.Sub(op.Add(tf, tf), j), op.Sub(tf, j))
    _, order = op.TopK(key, t, axis=-1, largest=1, sorted=1)  # [N, T]: attended columns first, in index order
    tail_shape = op.Concat(kv_heads, groups, n, t, axis=0)
    # allowzero: a prefill's T is 0, which Reshape would otherwise read as "keep the input's dimension"
    order_g = op.Reshape(
        op.Expand(op.Unsqueeze(order, [0, 1]), tail_shape), op.Concat(kv_heads, rows, t, axis=0), allowzero=1
    )
    return (mask_g, qg_shape, out_shape, ones, scale, b0, order, order_g, tail_shape, acc_shape, hd, hd1)


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttentionPlanned(
    q: FLOAT,
    k: FLOAT,
    v: FLOAT,
    mask_g: BOOL,
    qg_shape: INT64,
    out_shape: INT64,
    ones: FLOAT,
    scale: FLOAT,
    b0: INT64,
    order: INT64,
    order_g: INT64,
    tail_shape: INT64,
    acc_shape: INT64,
    hd: INT64,
    hd1: INT64,
) -> FLOAT:
    qg = op.Reshape(q, qg_shape)
    scores = op.Mul(op.MatMul(qg, op.Transpose(k, perm=[0, 2, 1])), scale)
    scores = op.Where(mask_g, scores, op.CastLike(op.Constant(value_float=-1e30), q))
    e = op.Exp(op.Sub(scores, op.ReduceMax(scores, op.Constant(value_ints=[-1]), keepdims=1)))
    v1 = op.Concat(v, ones, axis=-1)
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    last = op.Constant(value_ints=[-1])
    end = op.Constant(value_ints=[9223372036854775807])
    head = op.MatMul(op.Slice(e, zero, b0, last), op.Slice(v1, zero, b0, one))
    e_rows = op.GatherElements(op.Slice(e, b0, end, last), order_g, axis=2)  # [KVH, groups * N, T]
    v_rows = op.Gather(op.Slice(v1, b0, end, one), order, axis=1)  # [KVH, N, T, hd + 1]
    e_rows = op.Transpose(op.Reshape(e_rows, tail_shape, allowzero=1), perm=[0, 2, 1, 3])
    tail = op.Transpose(op.MatMul(e_rows, v_rows), perm=[0, 2, 1, 3])  # [KVH, groups, N, hd + 1]
    acc = op.Add(head, op.Reshape(tail, acc_shape))
    num = op.Slice(acc, zero, hd, last)
    den = op.Slice(acc, hd, hd1, last)
    return op.Reshape(op.Div(num, den), out_shape)

"""`dtrt::TreeAttention`, `dtrt::TreeAttentionOrderPlan`, `dtrt::TreeAttentionPlanned` as ONNX functions of standard
ops (the eager op: dtrt.ops.tree_attention)."""

import onnxscript
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function
from dtrt.ops.tree_attention import ORDER_ALIGN, ORDER_ROWS


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttention(q: FLOAT, k: FLOAT, v: FLOAT, mask: BOOL) -> FLOAT:
    # the query heads of a K/V head are rows of one product: no K/V head is repeated per query head (an Expand of
    # the whole past, twice a layer), and the keys' transpose folds into the product (ONNX Runtime's FusedMatMul)
    heads = op.Shape(q, start=0, end=1)
    n = op.Shape(q, start=1, end=2)
    hd = op.Shape(q, start=2, end=3)
    kv_heads = op.Shape(k, start=0, end=1)
    m = op.Shape(k, start=1, end=2)
    groups = op.Div(heads, kv_heads)
    rows = op.Mul(groups, n)
    qg = op.Reshape(q, op.Concat(kv_heads, rows, hd, axis=0))
    scale = op.Div(op.CastLike(op.Constant(value_float=1.0), q), op.Sqrt(op.CastLike(hd, q)))
    scores = op.Mul(op.MatMul(qg, op.Transpose(k, perm=[0, 2, 1])), scale)
    scores = op.Reshape(scores, op.Concat(kv_heads, groups, n, m, axis=0))
    scores = op.Where(mask, scores, op.CastLike(op.Constant(value_float=-1e30), q))
    weights = op.Reshape(op.Softmax(scores, axis=-1), op.Concat(kv_heads, rows, m, axis=0))
    return op.Reshape(op.MatMul(weights, v), op.Concat(heads, n, hd, axis=0))


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttentionOrderPlan(q: FLOAT, k_cache: FLOAT, mask: BOOL):
    heads = op.Shape(q, start=0, end=1)
    n = op.Shape(q, start=1, end=2)
    hd = op.Shape(q, start=2, end=3)
    kv_heads = op.Shape(k_cache, start=1, end=2)
    m = op.Shape(mask, start=1, end=2)
    p = op.Sub(m, n)
    groups = op.Div(heads, kv_heads)
    rows = op.Mul(groups, n)
    one = op.Constant(value_ints=[1])
    qg_shape = op.Concat(kv_heads, rows, hd, axis=0)
    out_shape = op.Concat(heads, n, hd, axis=0)
    mask_g = op.Reshape(op.Expand(op.Unsqueeze(mask, [0]), op.Concat(groups, n, m, axis=0)), op.Concat(rows, m, axis=0))
    hd1 = op.Add(hd, one)
    acc_shape = op.Concat(kv_heads, rows, hd1, axis=0)
    short = op.Squeeze(op.LessOrEqual(n, op.Constant(value_ints=[ORDER_ROWS])))
    if short:
        align = op.Constant(value_ints=[ORDER_ALIGN])
        b0 = op.Mul(op.Div(p, align), align)
    else:
        b0 = m
    b0p = op.Min(b0, p)
    hnew = op.Sub(b0, b0p)
    zero = op.Constant(value_ints=[0])
    head_end = op.Concat(one, b0p, axis=0)  # the cache's [layer, position] bounds, offset by each layer's [l, 0]
    tail_start = op.Concat(zero, b0p, axis=0)
    tail_end = op.Concat(one, p, axis=0)
    t = op.Sub(m, b0)
    unit = op.CastLike(op.Constant(value_float=1.0), q)
    ones_tail = op.Expand(unit, op.Concat(kv_heads, t, one, axis=0))
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
    return (
        mask_g,
        qg_shape,
        out_shape,
        ones_tail,
        b0,
        b0p,
        hnew,
        head_end,
        tail_start,
        tail_end,
        order,
        order_g,
        tail_shape,
        acc_shape,
        hd,
        hd1,
    )


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeAttentionPlanned(
    q: FLOAT,
    k_cache: FLOAT,
    k_new: FLOAT,
    v_cache: FLOAT,
    layer: INT64,
    v_new: FLOAT,
    scale: FLOAT,
    mask_g: BOOL,
    qg_shape: INT64,
    out_shape: INT64,
    ones_tail: FLOAT,
    b0: INT64,
    b0p: INT64,
    hnew: INT64,
    head_end: INT64,
    tail_start: INT64,
    tail_end: INT64,
    order: INT64,
    order_g: INT64,
    tail_shape: INT64,
    acc_shape: INT64,
    hd: INT64,
    hd1: INT64,
) -> FLOAT:
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    last = op.Constant(value_ints=[-1])
    end = op.Constant(value_ints=[9223372036854775807])
    cache_axes = op.Constant(value_ints=[0, 2])
    qg = op.Reshape(q, qg_shape)
    # the scores of the past and of the new keys side by side: the keys are never copied into one tensor; both
    # caches are read at the layer's own offset (`layer`: [l, 0]), the past's keys up to tail_end ([1, P])
    # `at` is `layer` read through the layer's own query: ONNX Runtime then slices each layer's past keys right
    # before that layer's product, not every layer's at the call's start (30 live copies of the past, twice slower)
    rows = op.Shape(qg, start=0, end=2)
    at = op.Add(layer, op.Sub(rows, rows))
    k_past = op.Squeeze(op.Slice(k_cache, at, op.Add(tail_end, at), cache_axes), zero)
    past_scores = op.MatMul(qg, op.Transpose(k_past, perm=[0, 2, 1]))
    new_scores = op.MatMul(qg, op.Transpose(k_new, perm=[0, 2, 1]))
    # `scale` (1 / sqrt(hd)) is a constant of the graph: ONNX Runtime folds it into each product
    scores = op.Concat(op.Mul(past_scores, scale), op.Mul(new_scores, scale), axis=-1)
    scores = op.Where(mask_g, scores, op.CastLike(op.Constant(value_float=-1e30), q))
    e = op.Exp(op.Sub(scores, op.ReduceMax(scores, last, keepdims=1)))
    # the head: the past's values read from the layer's cache (`layer`: [l, 0], where its past starts), the weights
    # summed row by row over the same columns; a prefill's head also holds the new columns (hnew = N; a decode's
    # hnew = 0 and that product is all zeros)
    v_head = op.Slice(v_cache, layer, op.Add(head_end, layer), cache_axes)  # [1, KVH, b0p, hd]
    num = op.MatMul(op.Slice(e, zero, b0p, last), v_head)  # [1, KVH, groups * N, hd]
    num = op.Add(num, op.MatMul(op.Slice(e, b0p, b0, last), op.Slice(v_new, zero, hnew, one)))
    den = op.ReduceSum(op.Slice(e, zero, b0, last), last, keepdims=1)  # [KVH, groups * N, 1]
    # the tail: its few columns gathered per row, values and sums in one product (the ones column appended)
    v_past_tail = op.Squeeze(op.Slice(v_cache, op.Add(tail_start, layer), op.Add(tail_end, layer), cache_axes), zero)
    v_tail = op.Concat(v_past_tail, op.Slice(v_new, hnew, end, one), axis=1)
    v1 = op.Concat(v_tail, ones_tail, axis=-1)  # [KVH, T, hd + 1]
    e_rows = op.GatherElements(op.Slice(e, b0, end, last), order_g, axis=2)  # [KVH, groups * N, T]
    v_rows = op.Gather(v1, order, axis=1)  # [KVH, N, T, hd + 1]
    e_rows = op.Transpose(op.Reshape(e_rows, tail_shape, allowzero=1), perm=[0, 2, 1, 3])
    tail = op.Reshape(op.Transpose(op.MatMul(e_rows, v_rows), perm=[0, 2, 1, 3]), acc_shape)  # [.., hd + 1]
    num = op.Add(num, op.Slice(tail, zero, hd, last))
    den = op.Add(den, op.Slice(tail, hd, hd1, last))
    return op.Reshape(op.Div(num, den), out_shape)

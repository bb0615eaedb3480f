"""`dtrt::TreeCausalConv1d` as ONNX functions of standard ops (the eager op: dtrt.ops.tree_causal_conv1d)."""

import onnxscript
from onnxscript import FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeCausalConv1d(x: FLOAT, parents: INT64, conv_state: FLOAT, weight: FLOAT) -> (FLOAT, FLOAT):
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    ctx = op.Squeeze(op.Sub(op.Shape(weight, start=1, end=2), one))
    n = op.Squeeze(op.Shape(x, start=0, end=1))
    src = op.Concat(op.Transpose(op.CastLike(conv_state, x), perm=[1, 0]), x, axis=0)
    columns = op.Max(op.Sub(op.Range(zero, ctx, one), one), zero)
    up = op.Concat(columns, op.Where(op.GreaterOrEqual(parents, zero), op.Add(parents, ctx), op.Sub(ctx, one)), axis=0)
    kernel = op.Range(zero, op.Add(ctx, one), one)
    cur = op.Range(ctx, op.Add(ctx, n), one)
    # rows [N, K]: column K-1 is the node, each hop fills the column before; fixed shape across the Loop
    rows = op.Expand(op.Unsqueeze(cur, [1]), op.Concat(op.Shape(cur), op.Shape(kernel), axis=0))
    for hop in range(ctx):
        cur = op.Gather(up, cur)
        rows = op.Where(op.Equal(kernel, op.Sub(op.Sub(ctx, hop), one)), op.Unsqueeze(cur, [1]), rows)
    window = op.Gather(src, rows)  # [N, K, C]
    conv = op.ReduceSum(
        op.Mul(window, op.Unsqueeze(op.Transpose(op.CastLike(weight, x), perm=[1, 0]), [0])),
        op.Constant(value_ints=[1]),
        keepdims=0,
    )
    out = op.Mul(conv, op.Sigmoid(conv))
    windows = op.Transpose(
        op.Slice(window, op.Constant(value_ints=[1]), op.Unsqueeze(op.Add(ctx, one), [0]), op.Constant(value_ints=[1])),
        perm=[0, 2, 1],
    )
    return out, windows

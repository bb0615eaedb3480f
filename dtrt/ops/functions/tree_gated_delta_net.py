"""`dtrt::TreeGatedDeltaNet` as ONNX functions of standard ops (the eager op: dtrt.ops.tree_gated_delta_net)."""

import onnxscript
from onnxscript import FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeGatedDeltaNet(
    q: FLOAT, k: FLOAT, v: FLOAT, g: FLOAT, beta: FLOAT, parents: INT64, state0: FLOAT
) -> (FLOAT, FLOAT):
    one = op.Constant(value_int=1)
    n = op.Shape(q, start=0, end=1)
    # slot 0 holds state0, slot i+1 the state after node i: a node reads slot parent+1
    slots = op.Concat(
        op.Unsqueeze(state0, [0]),
        op.Expand(op.CastLike(op.Constant(value_float=0.0), state0), op.Concat(n, op.Shape(state0), axis=0)),
        axis=0,
    )
    outs = op.Expand(op.CastLike(op.Constant(value_float=0.0), v), op.Shape(v))
    for i in range(op.Squeeze(n)):
        at = op.Unsqueeze(i, [0])
        s = op.Gather(slots, op.Add(op.Gather(parents, i), one))  # [H, dk, dv]
        s = op.Mul(s, op.Unsqueeze(op.Exp(op.Gather(g, i)), [1, 2]))
        k_i = op.Unsqueeze(op.Gather(k, i), [2])  # [H, dk, 1]
        kv = op.ReduceSum(op.Mul(s, k_i), op.Constant(value_ints=[1]), keepdims=0)  # [H, dv]
        delta = op.Mul(op.Sub(op.Gather(v, i), kv), op.Unsqueeze(op.Gather(beta, i), [1]))
        s = op.Add(s, op.Mul(k_i, op.Unsqueeze(delta, [1])))
        o = op.ReduceSum(op.Mul(s, op.Unsqueeze(op.Gather(q, i), [2])), op.Constant(value_ints=[1]), keepdims=0)
        slots = op.ScatterND(slots, op.Unsqueeze(op.Add(at, one), [0]), op.Unsqueeze(s, [0]))
        outs = op.ScatterND(outs, op.Unsqueeze(at, [0]), op.Unsqueeze(o, [0]))
    states = op.Slice(slots, op.Constant(value_ints=[1]), op.Add(n, one), op.Constant(value_ints=[0]))
    return outs, states

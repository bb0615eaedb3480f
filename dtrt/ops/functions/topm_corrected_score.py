"""`dtrt::TopMCorrectedScore` as ONNX functions of standard ops (the eager op: dtrt.ops.topm_corrected_score)."""

import onnxscript
from onnxscript import FLOAT
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TopMCorrectedScore(zproj: FLOAT, states: FLOAT, w1s: FLOAT, basec: FLOAT, w2c: FLOAT) -> FLOAT:
    sp = op.Cast(op.MatMul(op.CastLike(states, w1s), op.Transpose(w1s, perm=[1, 0])), to=FLOAT.dtype)
    x = op.Add(op.Unsqueeze(zproj, [1]), sp)
    h = op.Mul(x, op.Sigmoid(x))
    corrected = op.Add(op.Unsqueeze(basec, [1]), op.MatMul(h, op.Transpose(w2c, perm=[0, 2, 1])))
    out = op.LogSoftmax(corrected, axis=-1)
    return out

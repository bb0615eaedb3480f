"""`dtrt::BlockMatMul` and `dtrt::BlockMatMulMin` as ONNX functions of standard ops: the product of fp32 activations
with a quantized file's integer blocks (the reference: dtrt.models.blocks.block_matmul; the packing:
dtrt.models.blocks.pack_blocks).

    y[..., n] = sum_b scale[n, b] * sum_j (q[n, b*block + j] - zero) * x[..., b*block + j]
                (+ sum_b min[n, b] * sum_j x[..., b*block + j] for BlockMatMulMin)

q is uint8: `bits` 8, one code a byte ([N, K]); `bits` 4, two a byte ([N, K/2]), each block of `block` codes in
block/2 bytes, code i in the low nibble of byte i and code i + block/2 in its high nibble (GGUF's Q4_0 layout). scale
and min are fp32 [N, K/block]. BlockMatMulMin's body calls BlockMatMul's. The bodies expand the codes to fp32 weights
and run one MatMul: with q, scale and min initializers, ONNX Runtime folds the expansion into an fp32 weight at the
session's start. dtrt's ONNX Runtime kernel (dtrt.runtime.backends.ort_ops) runs in their place on the blocks
themselves.
"""

import onnxscript
from onnxscript import FLOAT, UINT8
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function


@register_function
@onnxscript.script(OPSET, default_opset=op)
def BlockMatMul(x: FLOAT, q: UINT8, scale: FLOAT, bits: int, block: int, zero: int) -> FLOAT:
    nbits = op.Constant(value_int=bits)
    size = op.Constant(value_int=block)
    eight = op.Constant(value_int=8)
    # the codes of a block's bytes, [N, K/block, 8/bits, block*bits/8]: for bits 4 the low nibbles, then the high
    shifts = op.Cast(op.Unsqueeze(op.Range(op.Constant(value_int=0), eight, nbits), [1]), to=UINT8.dtype)
    mask = op.Cast(op.Sub(op.Pow(op.Constant(value_int=2), nbits), op.Constant(value_int=1)), to=UINT8.dtype)
    per_block = op.Reshape(op.Div(op.Mul(size, nbits), eight), op.Constant(value_ints=[1]))
    rows = op.Shape(q, start=0, end=1)
    q4 = op.Reshape(q, op.Concat(rows, op.Constant(value_ints=[-1, 1]), per_block, axis=0))
    codes = op.BitwiseAnd(op.BitShift(q4, shifts, direction="RIGHT"), mask)
    codes = op.Sub(op.Cast(codes, to=FLOAT.dtype), op.Cast(op.Constant(value_int=zero), to=FLOAT.dtype))
    codes = op.Reshape(codes, op.Concat(op.Shape(scale), op.Reshape(size, op.Constant(value_ints=[1])), axis=0))
    w = op.Mul(op.Unsqueeze(scale, [2]), codes)  # scale * (q - zero): one rounding, as blocks.scaled_codes
    w = op.Reshape(w, op.Concat(rows, op.Constant(value_ints=[-1]), axis=0))
    return op.MatMul(x, op.Transpose(w, perm=[1, 0]))


@register_function
@onnxscript.script(OPSET, default_opset=op)
def BlockMatMulMin(x: FLOAT, q: UINT8, scale: FLOAT, min: FLOAT, bits: int, block: int, zero: int) -> FLOAT:
    scaled = BlockMatMul(x, q, scale, bits=bits, block=block, zero=zero)
    size = op.Constant(value_int=block)
    one = op.Reshape(size, op.Constant(value_ints=[1]))
    blocked = op.Reshape(x, op.Concat(op.Shape(x, start=0, end=-1), op.Constant(value_ints=[-1]), one, axis=0))
    sums = op.ReduceSum(blocked, op.Constant(value_ints=[-1]), keepdims=0)  # [..., K/block]
    return op.Add(scaled, op.MatMul(sums, op.Transpose(min, perm=[1, 0])))

"""TreeAttention: attention of N new tokens over past + new keys under an explicit mask, with GQA.

q [H, N, hd], k/v [KVH, M, hd] (M = past + new; H a multiple of KVH), mask bool [N, M] (True = attend),
out [H, N, hd]. The tree mask makes a node see the whole past, its ancestors and itself.
"""

import onnxscript
import torch
import torch.nn.functional as F
from onnxscript import BOOL, FLOAT
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

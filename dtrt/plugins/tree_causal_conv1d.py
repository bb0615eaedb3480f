"""TreeCausalConv1d kernel: a Gated-DeltaNet layer's causal depthwise convolution + SiLU over tree nodes
(dtrt.ops.tree_causal_conv1d). x [N, C], parents [N] int64, conv_state [C, K-1], weight [C, K]
-> out [N, C], windows [N, C, K-1], in x's dtype.

One program per (node, block of channels) walks the node's ancestor chain, newest first, continuing into the
committed conv state above the root, exactly as dtrt.ops.tree_causal_conv1d.window_index does.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import TRITON_TYPES, next_pow2


@triton.jit
def tree_causal_conv1d_kernel(
    x_ptr,
    parents_ptr,
    conv_state_ptr,
    weight_ptr,
    n_nodes,
    out_ptr,
    windows_ptr,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    CTX: tl.constexpr = K - 1
    acc = tl.zeros([BLOCK_C], tl.float32)
    row = i + CTX  # rows of cat(conv_state columns, x)
    for jj in tl.static_range(K):
        j = K - 1 - jj  # window column, newest first
        if row >= CTX:
            val = tl.load(x_ptr + (row - CTX) * C + c, mask=c_ok, other=0.0)
        else:
            val = tl.load(conv_state_ptr + c * CTX + row, mask=c_ok, other=0.0).to(x_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + c * K + j, mask=c_ok, other=0.0).to(x_ptr.dtype.element_ty)
        acc += val.to(tl.float32) * w.to(tl.float32)
        if j >= 1:
            tl.store(windows_ptr + (i * C + c) * CTX + (j - 1), val, mask=c_ok)
        if row >= CTX:
            p = tl.load(parents_ptr + row - CTX)
            row = tl.where(p >= 0, p + CTX, CTX - 1)
        else:
            row = tl.maximum(row - 1, 0)
    tl.store(out_ptr + i * C + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=c_ok)


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1
    block_c: int = 256


def config(channels: int, kernel: int) -> Launch:
    block_c = min(1024, next_pow2(channels, 32))
    return Launch({"C": channels, "K": kernel, "BLOCK_C": block_c}, block_c=block_c)


def signature(x_dtype: torch.dtype, state_dtype: torch.dtype, weight_dtype: torch.dtype) -> dict[str, str]:
    x = TRITON_TYPES[x_dtype]
    return {
        "x_ptr": f"*{x}",
        "parents_ptr": "*i64",
        "conv_state_ptr": f"*{TRITON_TYPES[state_dtype]}",
        "weight_ptr": f"*{TRITON_TYPES[weight_dtype]}",
        "n_nodes": "i32",
        "out_ptr": f"*{x}",
        "windows_ptr": f"*{x}",
    }


def run(x, parents, conv_state, weight):
    n, channels = x.shape
    kernel = weight.shape[-1]
    launch = config(channels, kernel)
    x = x.contiguous()
    out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a transposed input's strides
    windows = torch.empty(n, channels, kernel - 1, dtype=x.dtype, device=x.device)
    tree_causal_conv1d_kernel[(n, triton.cdiv(channels, launch.block_c))](
        x,
        parents.contiguous(),
        conv_state.contiguous(),
        weight.contiguous(),
        n,
        out,
        windows,
        **launch.constexprs,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out, windows

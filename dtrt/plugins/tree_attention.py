"""TreeAttention kernel: flash attention of N queries over M = past + new keys under the explicit tree mask,
with GQA. q [H, N, hd], k/v [KVH, M, hd], mask bool [N, M] -> out [H, N, hd] (dtrt.ops.tree_attention).

One program per (block of queries, head) walks the keys in blocks with an online softmax in fp32, skipping the
key blocks its queries may not see.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import TRITON_TYPES, next_pow2


@triton.jit
def attend_block(q, k, v, allowed, m_i, l_i, acc, SCALE: tl.constexpr):
    """One key block into the rows' online softmax (fp32): the rows' running max, sum and weighted values."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    n_q,
    n_kv,
    out_ptr,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    kvh = h // GROUPS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = rows < n_q, d < HEAD_DIM
    q = tl.load(
        q_ptr + (h * n_q + rows[:, None]) * HEAD_DIM + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, n_kv, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        col_ok = cols < n_kv
        allowed = (
            tl.load(
                mask_ptr + rows[:, None].to(tl.int64) * n_kv + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0,
            )
            != 0
        )
        # a key block no query of this block may see adds nothing: skip its K/V loads
        if tl.max(allowed.to(tl.int32)) > 0:
            kv_offs = (kvh * n_kv + cols[:, None]) * HEAD_DIM + d[None, :]
            kv_mask = col_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            m_i, l_i, acc = attend_block(q, k, v, allowed, m_i, l_i, acc, SCALE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (h * n_q + rows[:, None]) * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1
    block_n: int = 32


def config(head_dim: int, groups: int, dtype: torch.dtype) -> Launch:
    block_m = 32 if dtype == torch.float32 and head_dim > 64 else 64  # fp32 tiles within 48 KiB of shared memory
    return Launch(
        {
            "GROUPS": groups,
            "HEAD_DIM": head_dim,
            "SCALE": 1.0 / math.sqrt(head_dim),
            "BLOCK_D": next_pow2(head_dim, 16),
            "BLOCK_N": 32,
            "BLOCK_M": block_m,
        }
    )


def signature(dtype: torch.dtype) -> dict[str, str]:
    t = TRITON_TYPES[dtype]
    return {
        "q_ptr": f"*{t}",
        "k_ptr": f"*{t}",
        "v_ptr": f"*{t}",
        "mask_ptr": "*i1",
        "n_q": "i32",
        "n_kv": "i32",
        "out_ptr": f"*{t}",
    }


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    heads, n_q, head_dim = q.shape
    kv_heads, n_kv, _ = k.shape
    launch = config(head_dim, heads // kv_heads, q.dtype)
    q, k, v, mask = (t.contiguous() for t in (q, k, v, mask))
    out = torch.empty_like(q)  # after .contiguous(): empty_like keeps a transposed input's strides
    grid = (triton.cdiv(n_q, launch.block_n), heads)
    tree_attention_kernel[grid](
        q, k, v, mask, n_q, n_kv, out, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages
    )
    return out

"""StaticTreeAttention kernel: attention over a fixed-capacity cache by its committed length, split along the keys
as flash-decoding splits them; the torch backend's --static-shapes verify and --cuda-graph's draft block run it
(dtrt.models.layers.committed_attention). q [H, N, hd]; past_k/past_v [KVH, C, hd], of which the first `length`
columns (a device scalar) are committed and visible to every row; new_k/new_v [KVH, N, hd], the new tokens, under
the tree mask [N, N]; out [H, N, hd]. K/V are read in place through their strides (a cache's views pass uncopied).

The grid is fixed by the shapes alone, so one CUDA graph serves every length: (blocks of query rows, KV heads,
SPLITS + 1). Split s < SPLITS reads its share of the committed columns, the length read on the device (a split
past the length loads nothing), and the last split reads the new tokens' columns. Each program keeps one K/V head's
query rows (its GROUPS heads x N tokens, adjacent in q) so a key is loaded once for the group. The splits'
partial softmax states (max, sum, weighted values, fp32) are combined by `combine`. A verify of few tokens over
a long past thus spreads the past over many programs instead of walking it in one per head, and never reads the
capacity's columns past the length.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import next_pow2
from dtrt.plugins.tree_attention import attend_block


@triton.jit
def static_tree_attention_kernel(
    q_ptr,
    past_k_ptr,
    past_v_ptr,
    new_k_ptr,
    new_v_ptr,
    length_ptr,
    mask_ptr,
    n_q,
    past_head_stride,
    past_col_stride,
    new_head_stride,
    new_col_stride,
    m_ptr,
    l_ptr,
    acc_ptr,
    GROUPS: tl.constexpr,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n_rows = GROUPS * n_q  # this K/V head's query rows: head kvh * GROUPS + r // n_q, token r % n_q
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = rows < n_rows, d < HEAD_DIM
    first = kvh * n_rows  # the group's first row among all H * N
    q = tl.load(
        q_ptr + (first + rows[:, None]) * HEAD_DIM + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    # split s < SPLITS: its share of the committed past, every column visible (a share past the length is empty)
    length = tl.load(length_ptr).to(tl.int64)
    share = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_M) * BLOCK_M
    lo = tl.where(split < SPLITS, split * share, length)
    hi = tl.minimum(lo + share, length)
    for start in range(lo, hi, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        col_ok = cols < hi
        offs = kvh * past_head_stride + cols[:, None] * past_col_stride + d[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(past_k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(past_v_ptr + offs, mask=kv_mask, other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, row_ok[:, None] & col_ok[None, :], m_i, l_i, acc, SCALE)
    # the last split: the new tokens under the tree mask
    token = rows % n_q
    for start in range(0, tl.where(split == SPLITS, n_q, 0), BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        col_ok = cols < n_q
        seen = tl.load(mask_ptr + token[:, None] * n_q + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
        offs = kvh * new_head_stride + cols[:, None] * new_col_stride + d[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(new_k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(new_v_ptr + offs, mask=kv_mask, other=0.0)
        m_i, l_i, acc = attend_block(q, k, v, seen != 0, m_i, l_i, acc, SCALE)
    state = split.to(tl.int64) * (n_rows * tl.num_programs(1)) + first + rows
    tl.store(m_ptr + state, m_i, mask=row_ok)
    tl.store(l_ptr + state, l_i, mask=row_ok)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1


PROGRAMS = 128  # about as many programs as a large GPU has multiprocessors: the splits fill what the rows leave


def config(*, head_dim: int, groups: int, n_q: int, kv_heads: int, dtype: torch.dtype) -> Launch:
    """The launch for these shapes; the split count depends on them alone (never on the length), so the grid of a
    captured call holds for every length."""
    block_m = 32 if dtype == torch.float32 and head_dim > 64 else 64  # fp32 tiles within 48 KiB of shared memory
    block_r = min(64, next_pow2(groups * n_q, 16))
    row_blocks = -(-groups * n_q // block_r)
    splits = max(1, min(32, PROGRAMS // (row_blocks * kv_heads)))
    return Launch(
        {
            "GROUPS": groups,
            "SPLITS": splits,
            "HEAD_DIM": head_dim,
            "SCALE": 1.0 / math.sqrt(head_dim),
            "BLOCK_D": next_pow2(head_dim, 16),
            "BLOCK_R": block_r,
            "BLOCK_M": block_m,
        }
    )


def combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """The splits' partial states [S + 1, rows(, hd)] -> the rows' attention [rows, hd] (fp32). Every row sees at
    least itself in the tree's split, so each row's maximum is finite."""
    top = m.max(0).values
    w = torch.exp(m - top)  # an empty split (max -inf) weighs 0
    return (w[..., None] * acc).sum(0) / (w * l).sum(0)[..., None]


def _strided(k, v):
    """(k, v) sharing one layout whose last dimension is packed (views of a cache pass as they are)."""
    if k.stride(-1) != 1 or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    return k, v


def run(q, past_k, past_v, length, new_k, new_v, tree):
    heads, n_q, head_dim = q.shape
    kv_heads = past_k.shape[0]
    launch = config(head_dim=head_dim, groups=heads // kv_heads, n_q=n_q, kv_heads=kv_heads, dtype=q.dtype)
    c = launch.constexprs
    (past_k, past_v), (new_k, new_v) = _strided(past_k, past_v), _strided(new_k, new_v)
    q, tree = q.contiguous(), tree.contiguous()
    rows = heads * n_q
    m = torch.empty(c["SPLITS"] + 1, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    acc = torch.empty(c["SPLITS"] + 1, rows, head_dim, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(c["GROUPS"] * n_q, c["BLOCK_R"]), kv_heads, c["SPLITS"] + 1)
    static_tree_attention_kernel[grid](
        q, past_k, past_v, new_k, new_v, length, tree, n_q, past_k.stride(0), past_k.stride(1), new_k.stride(0),
        new_k.stride(1), m, l, acc, **c, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return combine(m, l, acc).view(heads, n_q, head_dim).to(q.dtype)

"""LedgerSelect kernel: the frontier's selection, from the filled ledger to the flat tree
(dtrt.ops.ledger_select). scores [bs, D, Wk] fp32, tokens/parents [bs, D, Wk] int64, root [bs] int64;
budget B and mask_token_id fixed at compile time -> tokens, parents, depths [bs, N] int64, scores [bs, N] fp32,
mask [bs, N, N] bool (N = B + 1).

One program per request. The stable descending order is one sort of int64 keys (the score's order-preserving
bits, then the ledger index, so ties keep ledger order); the first B indices are parked in the depths row,
which is overwritten once they are read back. Parents are remapped by matching ledger indices, and the
ancestor mask is built by D parent hops, as the reference does.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import next_pow2

MAX_LEDGER = 16384  # entries one program sorts in registers


@triton.jit
def ledger_select_kernel(
    scores_ptr,
    tokens_ptr,
    parents_ptr,
    root_ptr,
    out_tokens_ptr,
    out_parents_ptr,
    out_depths_ptr,
    out_scores_ptr,
    out_mask_ptr,
    D: tl.constexpr,
    WK: tl.constexpr,
    BUDGET: tl.constexpr,
    MASK_TOKEN: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    L: tl.constexpr = D * WK
    N: tl.constexpr = BUDGET + 1
    i = tl.arange(0, BLOCK_L).to(tl.int64)
    s = tl.load(scores_ptr + b * L + i, mask=i < L, other=float("-inf")) + 0.0  # -0.0 sorts as 0.0
    bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(s >= 0.0, bits + 0x80000000, 0xFFFFFFFF - bits)  # increasing with the score
    key = (0x7FFFFFFF - ordered) * 0x100000000 + i  # ascending key = descending score, then ledger order
    key = tl.where(i < L, key, 0x7FFFFFFFFFFFFFFF)
    sel = tl.sort(key) & 0xFFFFFFFF
    row = b * N
    tl.store(out_depths_ptr + row + 1 + i, sel, mask=i < BUDGET)
    tl.debug_barrier()

    r = tl.arange(0, BLOCK_N).to(tl.int64)
    node = (r >= 1) & (r < N)
    sel_r = tl.load(out_depths_ptr + row + r, mask=node, other=0)
    sc = tl.load(scores_ptr + b * L + sel_r, mask=node, other=float("-inf"))
    valid = node & (sc > float("-inf"))
    tok = tl.load(tokens_ptr + b * L + sel_r, mask=node, other=0)
    par = tl.load(parents_ptr + b * L + sel_r, mask=node, other=-1)
    # tree index of each node's ledger parent (0, the root, when it was not selected)
    match = (sel_r[None, :] == par[:, None]) & node[None, :]
    parent_index = tl.max(tl.where(match, r[None, :], 0), axis=1)
    root = tl.load(root_ptr + b)
    out_parents = tl.where(r == 0, -1, tl.where(valid, parent_index, 0))
    tl.debug_barrier()
    tl.store(out_tokens_ptr + row + r, tl.where(r == 0, root, tl.where(valid, tok, MASK_TOKEN)), mask=r < N)
    tl.store(out_parents_ptr + row + r, out_parents, mask=r < N)
    tl.store(out_depths_ptr + row + r, tl.where(r == 0, 0, tl.where(valid, sel_r // WK + 1, 1)), mask=r < N)
    tl.store(out_scores_ptr + row + r, tl.where(r == 0, 0.0, sc), mask=r < N)
    tl.debug_barrier()

    mask = r[:, None] == r[None, :]
    cur = out_parents
    for _ in range(D):
        alive = cur >= 0
        mask = mask | ((cur[:, None] == r[None, :]) & alive[:, None])
        up = tl.load(out_parents_ptr + row + tl.maximum(cur, 0), mask=r < N, other=-1)
        cur = tl.where(alive, up, cur)
    inside = (r[:, None] < N) & (r[None, :] < N)
    tl.store(out_mask_ptr + b * N * N + r[:, None] * N + r[None, :], mask, mask=inside)


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1


def config(depth: int, wk: int, budget: int, mask_token_id: int) -> Launch:
    ledger = depth * wk
    if ledger > MAX_LEDGER:
        raise ValueError(
            f"the LedgerSelect kernel sorts at most {MAX_LEDGER} ledger entries in one program; this "
            f"ledger has {depth} x {wk} = {ledger} (lower the budget or node_topk)"
        )
    block_l = next_pow2(ledger, 16)
    return Launch(
        {
            "D": depth,
            "WK": wk,
            "BUDGET": budget,
            "MASK_TOKEN": mask_token_id,
            "BLOCK_L": block_l,
            "BLOCK_N": next_pow2(budget + 1, 16),
        },
        num_warps=8 if block_l >= 4096 else 4,
    )


SIGNATURE = {
    "scores_ptr": "*fp32",
    "tokens_ptr": "*i64",
    "parents_ptr": "*i64",
    "root_ptr": "*i64",
    "out_tokens_ptr": "*i64",
    "out_parents_ptr": "*i64",
    "out_depths_ptr": "*i64",
    "out_scores_ptr": "*fp32",
    "out_mask_ptr": "*i1",
}


def run(scores, tokens, parents, root, budget: int, mask_token_id: int):
    bs, depth, wk = scores.shape
    launch = config(depth, wk, budget, mask_token_id)
    n, dev = budget + 1, scores.device
    outs = (
        torch.empty(bs, n, dtype=torch.long, device=dev),
        torch.empty(bs, n, dtype=torch.long, device=dev),
        torch.empty(bs, n, dtype=torch.long, device=dev),
        torch.empty(bs, n, dtype=torch.float32, device=dev),
        torch.empty(bs, n, n, dtype=torch.bool, device=dev),
    )
    ledger_select_kernel[(bs,)](
        scores.float().contiguous(),
        tokens.contiguous(),
        parents.contiguous(),
        root.contiguous(),
        *outs,
        **launch.constexprs,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return outs

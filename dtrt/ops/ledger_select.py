"""LedgerSelect: the frontier builder's selection step, from the filled ledger to the flat tree.

scores [bs, D, Wk] fp32 (cumulative log-probs, -inf = unreachable), tokens [bs, D, Wk] int64,
parents [bs, D, Wk] int64 (flat ledger index d * Wk + j of the parent, -1 = the root), root [bs] int64;
attributes budget B, mask_token_id
-> tokens, parents, depths [bs, N] int64, scores [bs, N] fp32, mask [bs, N, N] bool (N = B + 1, column 0 the root).

The tree is the first B entries of a stable descending sort of the depth-major ledger (on a score tie a parent,
being shallower, precedes its child). Ledger parents are remapped to tree indices, unreachable slots become
mask_token_id leaves under the root, and the ancestor mask is built by D parent hops.
"""

import torch

from dtrt.ops.base import emit
from dtrt.ops.kernels import kernel


def ledger_select_ref(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    root: torch.Tensor,
    budget: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, D, Wk = scores.shape
    L, N, dev = D * Wk, budget + 1, scores.device
    sorted_scores, order = torch.sort(scores.reshape(bs, L), dim=1, descending=True, stable=True)
    sel, sel_scores = order[:, :budget], sorted_scores[:, :budget]
    valid = torch.isfinite(sel_scores)
    sel_tokens = torch.gather(tokens.reshape(bs, L), 1, sel)
    sel_parents = torch.gather(parents.reshape(bs, L), 1, sel)

    position = torch.full((bs, L), -1, dtype=torch.long, device=dev)
    position.scatter_(1, sel, torch.arange(budget, device=dev).expand(bs, budget).contiguous())
    parent_index = torch.where(sel_parents < 0, 0, torch.gather(position, 1, sel_parents.clamp(min=0)) + 1)

    zero = torch.zeros((bs, 1), dtype=torch.long, device=dev)
    out_tokens = torch.cat((root.reshape(bs, 1), torch.where(valid, sel_tokens, mask_token_id)), 1)
    out_parents = torch.cat((zero - 1, torch.where(valid, parent_index, 0)), 1)
    depths = torch.cat((zero, torch.where(valid, sel // Wk + 1, 1)), 1)
    out_scores = torch.cat((torch.zeros((bs, 1), device=dev), sel_scores), 1)

    # ancestors by D parent hops; one-hot rows by comparison, not by indexing with device tensors
    columns = torch.arange(N, device=dev)
    mask = torch.eye(N, dtype=torch.bool, device=dev).expand(bs, N, N).clone()
    cur = out_parents
    for _ in range(D):
        alive = cur >= 0
        mask |= (cur[..., None] == columns) & alive[..., None]
        cur = torch.where(alive, torch.gather(out_parents, 1, cur.clamp(min=0)), cur)
    return out_tokens, out_parents, depths, out_scores, mask


torch.library.custom_op("dtrt::ledger_select", mutates_args=())(ledger_select_ref)


def ledger_select(scores, tokens, parents, root, budget: int, mask_token_id: int):
    """A `dtrt::LedgerSelect` node during ONNX export; eagerly the Triton kernel or the reference
    (dtrt.ops.kernels)."""
    if torch.onnx.is_in_onnx_export():
        bs, n = scores.shape[0], budget + 1
        return emit(
            "LedgerSelect",
            (scores, tokens, parents, root),
            (torch.int64, torch.int64, torch.int64, torch.float32, torch.bool),
            ((bs, n), (bs, n), (bs, n), (bs, n), (bs, n, n)),
            {"budget": budget, "mask_token_id": mask_token_id},
        )
    if (run := kernel("ledger_select", scores)) is not None:
        return run(scores, tokens, parents, root, budget, mask_token_id)
    return ledger_select_ref(scores, tokens, parents, root, budget, mask_token_id)

"""LedgerSelect: the frontier builder's selection step, from the filled ledger to the flat tree.

scores [bs, D, Wk] fp32 (cumulative log-probs, -inf = unreachable), tokens [bs, D, Wk] int64,
parents [bs, D, Wk] int64 (flat ledger index d * Wk + j of the parent, -1 = the root), root [bs] int64;
attributes budget B, mask_token_id
-> tokens, parents, depths [bs, N] int64, scores [bs, N] fp32, mask [bs, N, N] bool (N = B + 1, column 0 the root).

The tree is the first B entries of a stable descending sort of the depth-major ledger (on a score tie a parent,
being shallower, precedes its child). Ledger parents are remapped to tree indices, unreachable slots become
mask_token_id leaves under the root, and the ancestor mask is built by D parent hops.
"""

import onnxscript
import torch
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.base import OPSET, emit, register_function
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


@register_function
@onnxscript.script(OPSET, default_opset=op)
def LedgerSelect(
    scores: FLOAT, tokens: INT64, parents: INT64, root: INT64, budget: int, mask_token_id: int
) -> (INT64, INT64, INT64, FLOAT, BOOL):
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    bs = op.Shape(scores, start=0, end=1)
    wk = op.Shape(scores, start=2, end=3)
    flat = op.Concat(bs, op.Constant(value_ints=[-1]), axis=0)
    s = op.Reshape(scores, flat)
    b = op.Reshape(op.Constant(value_int=budget), op.Constant(value_ints=[1]))

    # The stable order without trusting TopK's tie order (ONNX specifies lower index first, TensorRT does not
    # promise it): TopK only supplies the sorted values, and sorted rank r is the ledger entry with that value
    # whose place among the equal entries, in ledger order, is r minus the number of entries strictly above.
    # [bs, B, L] comparisons, no [L, L] table.
    values, unused = op.TopK(s, b, axis=1, largest=1, sorted=1)
    v = op.Unsqueeze(values, [2])
    x = op.Unsqueeze(s, [1])
    equal = op.Equal(x, v)
    ahead = op.ReduceSum(op.Cast(op.Greater(x, v), to=INT64.dtype), op.Constant(value_ints=[2]), keepdims=1)
    ranks = op.Range(zero, op.Squeeze(b), one)
    rank = op.Unsqueeze(ranks, [0, 2])
    among_equal = op.Sub(op.CumSum(op.Cast(equal, to=INT64.dtype), op.Constant(value_int=2)), one)
    hit = op.And(equal, op.Equal(among_equal, op.Sub(rank, ahead)))
    ledger_index = op.Range(zero, op.Squeeze(op.Shape(s, start=1, end=2)), one)
    sel = op.ReduceSum(op.Where(hit, ledger_index, zero), op.Constant(value_ints=[2]), keepdims=0)

    valid = op.And(op.Not(op.IsInf(values)), op.Equal(values, values))
    sel_tokens = op.GatherElements(op.Reshape(tokens, flat), sel, axis=1)
    sel_parents = op.GatherElements(op.Reshape(parents, flat), sel, axis=1)
    position = op.ScatterElements(
        op.Expand(op.Constant(value_int=-1), op.Shape(s)),
        sel,
        op.Expand(op.Unsqueeze(ranks, [0]), op.Shape(sel)),
        axis=1,
    )
    parent_index = op.Add(op.GatherElements(position, op.Max(sel_parents, zero), axis=1), one)
    parent_index = op.Where(op.Less(sel_parents, zero), zero, parent_index)

    column = op.Concat(bs, op.Constant(value_ints=[1]), axis=0)
    out_tokens = op.Concat(
        op.Unsqueeze(root, [1]), op.Where(valid, sel_tokens, op.Constant(value_int=mask_token_id)), axis=1
    )
    out_parents = op.Concat(op.Expand(op.Constant(value_int=-1), column), op.Where(valid, parent_index, zero), axis=1)
    depths = op.Concat(op.Expand(zero, column), op.Where(valid, op.Add(op.Div(sel, wk), one), one), axis=1)
    out_scores = op.Concat(op.Expand(op.Constant(value_float=0.0), column), values, axis=1)

    nodes = op.Range(zero, op.Add(op.Squeeze(b), one), one)
    mask = op.Expand(
        op.Equal(op.Unsqueeze(nodes, [1]), op.Unsqueeze(nodes, [0])),
        op.Concat(bs, op.Shape(nodes), op.Shape(nodes), axis=0),
    )
    cur = out_parents  # D parent hops: an ONNX Loop whose trip count is the ledger's depth
    for unused_hop in range(  # noqa: B007 (onnxscript turns this loop into an ONNX Loop)
        op.Squeeze(op.Shape(scores, start=1, end=2))
    ):
        alive = op.GreaterOrEqual(cur, zero)
        mask = op.Or(mask, op.And(op.Equal(op.Unsqueeze(cur, [2]), nodes), op.Unsqueeze(alive, [2])))
        cur = op.Where(alive, op.GatherElements(out_parents, op.Max(cur, zero), axis=1), cur)
    return out_tokens, out_parents, depths, out_scores, mask

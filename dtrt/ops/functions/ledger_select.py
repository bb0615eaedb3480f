"""`dtrt::LedgerSelect` as ONNX functions of standard ops (the eager op: dtrt.ops.ledger_select)."""

import onnxscript
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.functions.opset import OPSET, register_function


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

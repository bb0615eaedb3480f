"""Rows on demand: a round asks the drafter's block for the rows its tree can reach (Method.rows), and the trees,
round by round, and the tokens are those built from every row, on the torch and ONNX Runtime backends."""

import itertools
from types import SimpleNamespace

import pytest
from helpers import generate_all, pipe_for, spec

from dtrt.errors import DtrtError
from dtrt.runtime import methods
from dtrt.tree import CostCurve

pytestmark = pytest.mark.usefixtures("one_thread")

LINEAR_COST = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)
ALL = "every row"
CHAIN_DEPTH = 4  # the loop gives a chain every depth; a shorter one asks for fewer rows
CASES = [
    spec("dflash"),
    spec("domino"),
    spec("ddtree", budget=4),
    spec("dominotree", budget=4),
    spec("cadominotree", budget=6),
]


def fake_clock():
    """A clock that ticks 1 ms a reading, for cadominotree: its tree sizes follow its timings, which must not
    differ between the two runs compared."""
    ticks = itertools.count()
    return SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3)


def run(pair, draft, backend, export, full: bool, monkeypatch):
    """(tokens per prompt, every round's (rows asked, rows computed, tree tokens, tree parents)); `full`: the block
    computes every row whatever the round asks."""
    monkeypatch.setattr(methods, "time", fake_clock())
    threads = 1 if backend == "onnxruntime" else None
    pipe = pipe_for(pair, draft, backend=backend, export=export, threads=threads)
    method, block = pipe.method, pipe.backend.draft_block
    if draft.method.startswith("ca"):
        method.curve = LINEAR_COST
        # every round drafts: whether a round drafts at all is the gate's call on measured times, not what is
        # checked here (on an AVX-512 CPU the gate stopped drafting after a few rounds of the int4 drafter stages)
        method.gate.drafts = lambda clock, root_verify_s: True
    if draft.method in ("dflash", "domino"):
        prepare = method.prepare
        method.prepare = lambda backend, max_depth: prepare(backend, CHAIN_DEPTH)
    k_draft, asked, rounds = pipe.backend.drafter.cfg.k_draft, [], []

    def draft_block(root, start, *, rows):
        asked.append(rows)
        return block(root, start, rows=k_draft if full else rows)

    pipe.backend.draft_block = draft_block
    real_draft = method.draft

    def draft(backend, root, start):
        tree, t = real_draft(backend, root, start)
        rounds.append((asked[-1], tree.tokens.tolist(), tree.parents.tolist()))
        return tree, t

    method.draft = draft
    gens = generate_all(pipe)
    return [g.tokens for g in gens], rounds, [r.accepted for g in gens for r in g.rounds], k_draft


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "onnxruntime-int4"])
@pytest.mark.parametrize("draft", CASES, ids=lambda d: f"{d.method}-b{d.budget}")
def test_trees_are_those_of_every_row(request, tiny, tiny_export, torch_tokens, draft, backend, monkeypatch):
    """onnxruntime-int4: the export's drafter stages as the first-use export quantizes them (--drafter-quant int4)."""
    exp = request.getfixturevalue("tiny_export_int4") if backend.endswith("int4") else tiny_export
    pair, export = (tiny, None) if backend == "torch" else (None, exp.path)
    backend = backend.partition("-")[0]
    tokens, rounds, accepted, k_draft = run(pair, draft, backend, export, False, monkeypatch)
    full_tokens, full_rounds, _, _ = run(pair, draft, backend, export, True, monkeypatch)
    assert tokens == full_tokens == torch_tokens
    assert len(rounds) == len(full_rounds) > 0
    for i, (a, b) in enumerate(zip(rounds, full_rounds)):
        assert a[1:] == b[1:], f"round {i}: {a} != {b}"
    asked = {r[0] for r in rounds}
    want = CHAIN_DEPTH if draft.method in ("dflash", "domino") else min(draft.budget, k_draft)
    assert asked == {want} and want < k_draft, asked
    # drafts accepted, deep ones too, in a good share of the rounds (the share moves with the CPU's float rounding:
    # cadominotree@6 on torch accepted a draft in 51 of 105 rounds on an AVX2-only CPU)
    assert max(accepted) > 2 and sum(a > 1 for a in accepted) > len(accepted) // 3, accepted


def test_the_block_computes_the_rows_asked(tiny):
    backend = pipe_for(tiny, spec("dominotree")).backend
    backend.reset(32)
    k_draft = backend.drafter.cfg.k_draft
    full = backend.draft_block(3, 0, rows=k_draft)
    assert [x.shape[0] for x in full] == [k_draft, k_draft]
    for rows in (1, 2, k_draft - 1):
        ph, base = backend.draft_block(3, 0, rows=rows)
        assert ph.shape == (rows, full[0].shape[1]) and base.shape == (rows, full[1].shape[1])
        assert (base - full[1][:rows]).abs().max() < 1e-5
    for bad in (0, k_draft + 1, 2.0):
        with pytest.raises(DtrtError, match=rf"^draft_block: rows {bad!r} must be an int in 1\.\.{k_draft} "):
            backend.draft_block(3, 0, rows=bad)


@pytest.mark.parametrize(
    "draft,rows,rows_at_depth_2",
    [
        (spec("ddtree", budget=3), 3, 3),  # build_ddtree reads every row it is given, not max_depth
        (spec("ddtree", budget=40), ALL, ALL),
        (spec("dominotree", budget=5), 5, 2),
        (spec("dominotree", budget=5, builder="frontier"), ALL, ALL),  # the frontier stage's fixed shapes
        (spec("cadominotree", budget=3), 3, 2),  # its cap: the tree's size is chosen after drafting
        (spec("dflash", budget=3), ALL, 2),  # a chain: its depth, whatever the budget
        (spec("domino"), ALL, 2),
    ],
    ids=lambda x: f"{x.method}-{x.builder}-b{x.budget}" if hasattr(x, "method") else str(x),
)
def test_each_method_asks_for_the_rows_its_tree_reaches(tiny, draft, rows, rows_at_depth_2):
    pipe = pipe_for(tiny, draft)
    k_draft = pipe.backend.drafter.cfg.k_draft  # 7 for the tiny DFlash drafter, 8 for its Domino one
    pipe.method.max_depth = k_draft  # as Method.prepare sets it after the prefill
    assert pipe.method.rows(pipe.backend) == (k_draft if rows is ALL else rows)
    pipe.method.max_depth = 2
    assert pipe.method.rows(pipe.backend) == (k_draft if rows_at_depth_2 is ALL else rows_at_depth_2)

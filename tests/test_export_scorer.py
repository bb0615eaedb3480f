"""The Domino scorer and frontier stages: the two ops against the code they replace, their ONNX function bodies in
ONNX Runtime, and every exported stage (and the trees built on them) against PyTorch."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import drafter_json, write_drafter
from onnx import TensorProto, helper
from torch import nn

from dtrt.exporter.onnx_export import export_stage
from dtrt.exporter.scorer_stages import scorer_stages
from dtrt.models.checkpoint import load_drafter, load_target
from dtrt.models.domino import DominoHead
from dtrt.ops.base import onnx_functions
from dtrt.ops.ledger_select import ledger_select_ref
from dtrt.ops.topm_corrected_score import topm_corrected_score_ref
from dtrt.scoring import DominoScorer
from dtrt.scoring.stages import StageDominoScorer
from dtrt.tree import Round, build_frontier, build_heap
from dtrt.tree.topk import topk_lower_first

V, H, G, E = 89, 12, 10, 24
BUDGET, TOPM, K = 12, 16, 4
OPS = {
    "scorer_root": set(),
    "scorer_setup": set(),
    "scorer_children": {"TopMCorrectedScore"},
    "scorer_advance": set(),
    "frontier": {"TopMCorrectedScore", "LedgerSelect"},
}


def small_model(dtype=torch.float32):
    torch.manual_seed(0)
    head, embed = DominoHead(hidden=H, gru_dim=G, emb_dim=E, vocab=V), nn.Embedding(V, H)
    with torch.no_grad():
        for p in head.parameters():  # large enough that the correction reorders candidates
            p.normal_(0, 0.5)
    return head.to(dtype), embed.to(dtype)


def random_round(bs, depth, hidden, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return Round(
        torch.randn(bs, depth, hidden, generator=g).to(dtype),
        2 * torch.randn(bs, depth, vocab, generator=g),
        torch.randint(0, vocab - 1, (bs,), generator=g),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_topm_corrected_score_is_the_domino_scorer(dtype):
    head, embed = small_model(dtype)
    bs, D, n, k = 2, 4, 5, 3
    rnd = random_round(bs, D, H, V, seed=1, dtype=dtype)
    sc = DominoScorer(rnd, head, embed, k, 8, 1)
    states = torch.randn(bs, n, G).to(dtype)
    for d in range(1, D):
        lp = topm_corrected_score_ref(sc.zp[:, d], states, sc.w1s, sc.basec[:, d], sc.w2c[:, d])
        assert lp.shape == (bs, n, 8) and lp.dtype == torch.float32
        assert torch.equal(
            lp, torch.ops.dtrt.topm_corrected_score(sc.zp[:, d], states, sc.w1s, sc.basec[:, d], sc.w2c[:, d])
        )
        top, local = torch.topk(lp, k, dim=-1)
        tokens, logprobs = sc.children(states, d)
        assert torch.equal(logprobs, top)
        assert torch.equal(tokens, torch.gather(sc.cand[:, d, None].expand(bs, n, 8), -1, local))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_lower_first_orders_equal_values_by_index(dtype):
    """ONNX TopK's order, which the scorer_setup graph runs: higher values first, equal ones (-0.0 and 0.0 too) by
    the lower index; torch.topk leaves equal values in whatever order its kernel ends with."""
    x = torch.randint(-2, 3, (3, 5, 40), generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 0], x[1, 1, ::2], x[2, 2, 7:] = float("-inf"), -0.0, float("-inf")
    for dim, k in ((-1, 1), (-1, 12), (-1, 40), (1, 3)):
        values, index = topk_lower_first(x, k, dim)
        rows = x.movedim(dim, -1).reshape(-1, x.shape[dim]).tolist()
        want = [sorted(range(len(r)), key=lambda i: (-r[i], i))[:k] for r in rows]
        assert index.movedim(dim, -1).reshape(-1, k).tolist() == want
        assert torch.equal(values, x.gather(dim, index))


def naive_select(scores, tokens, parents, root, budget, mask_token_id):
    """One request, written out: stable descending order, parents remapped, -inf slots as padding leaves."""
    D, Wk = len(scores), len(scores[0])
    flat = [(scores[d][j], tokens[d][j], parents[d][j], d) for d in range(D) for j in range(Wk)]
    order = sorted(range(len(flat)), key=lambda i: -flat[i][0])[:budget]  # sorted() is stable
    where = {e: r + 1 for r, e in enumerate(order)}
    out = [(root, -1, 0, 0.0)]
    for e in order:
        s, tok, par, d = flat[e]
        out.append((tok, where.get(par, 0), d + 1, s) if s != float("-inf") else (mask_token_id, 0, 1, s))
    n = len(out)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = out[j][1]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out], [o[3] for o in out], mask


def tied_ledger(bs, D, Wk, seed):
    """A ledger as the frontier fills it, with scores on a coarse grid (many ties) and a dead lane per depth."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.full((bs, D, Wk), float("-inf"))
    parents = torch.full((bs, D, Wk), -1, dtype=torch.long)
    scores[:, 0] = -torch.randint(0, 3, (bs, Wk), generator=g).float()
    for d in range(1, D):
        parents[:, d] = (d - 1) * Wk + torch.randint(0, Wk, (bs, Wk), generator=g)
        parent_scores = torch.gather(scores.reshape(bs, -1), 1, parents[:, d])
        scores[:, d] = parent_scores - torch.randint(0, 3, (bs, Wk), generator=g).float()
    scores[:, :, -1] = float("-inf")
    return scores, torch.randint(0, 50, (bs, D, Wk), generator=g), parents, torch.randint(0, 50, (bs,), generator=g)


@pytest.mark.parametrize("budget", [1, 7, 23])
def test_ledger_select_is_a_stable_top_b(budget):
    for seed in range(5):
        ledger = tied_ledger(3, 4, 6, seed)
        got = ledger_select_ref(*ledger, budget, 99)
        assert [t.shape for t in got] == [(3, budget + 1)] * 4 + [(3, budget + 1, budget + 1)]
        assert [t.dtype for t in got] == [torch.long] * 3 + [torch.float32, torch.bool]
        for b in range(3):
            want = naive_select(*[x[b].tolist() for x in ledger], budget, 99)
            for g, w in zip(got, want):
                assert g[b].tolist() == w


def single_node_session(op_type, inputs, outputs, **attrs):
    node = helper.make_node(op_type, [i for i, _ in inputs], [o for o, _ in outputs], domain="dtrt", **attrs)
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node], op_type, [value(i, t, None) for i, t in inputs], [value(o, t, None) for o, t in outputs]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("dtrt", 1)])
    model.functions.extend(onnx_functions([op_type]))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("budget", [1, 7, 23])
def test_ledger_select_function_body_keeps_the_stable_order(budget):
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    sess = single_node_session(
        "LedgerSelect",
        [("scores", f32), ("tokens", i64), ("parents", i64), ("root", i64)],
        [
            ("tree_tokens", i64),
            ("tree_parents", i64),
            ("depths", i64),
            ("tree_scores", f32),
            ("mask", TensorProto.BOOL),
        ],
        budget=budget,
        mask_token_id=99,
    )
    for seed in range(10):
        ledger = tied_ledger(1 + seed % 3, 4, 6, seed)
        want = ledger_select_ref(*ledger, budget, 99)
        got = sess.run(None, dict(zip(("scores", "tokens", "parents", "root"), (x.numpy() for x in ledger))))
        for g, w in zip(got, want):
            assert g.dtype == w.numpy().dtype and np.array_equal(g, w.numpy())


def test_topm_corrected_score_function_body():
    sess = single_node_session(
        "TopMCorrectedScore",
        [(n, TensorProto.FLOAT) for n in ("zproj", "states", "w1s", "basec", "w2c")],
        [("logprobs", TensorProto.FLOAT)],
    )
    g = torch.Generator().manual_seed(0)
    x = {
        "zproj": torch.randn(2, E, generator=g),
        "states": torch.randn(2, 5, G, generator=g),
        "w1s": torch.randn(E, G, generator=g),
        "basec": 2 * torch.randn(2, 7, generator=g),
        "w2c": torch.randn(2, 7, E, generator=g),
    }
    got = sess.run(None, {k: v.numpy() for k, v in x.items()})[0]
    assert np.allclose(got, topm_corrected_score_ref(**x).numpy(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def models(tiny):
    target, drafter = load_target(tiny.target), load_drafter(tiny.domino)
    return target, drafter


def export_all(stages, tmp):
    out = {}
    for stage in stages:
        path = tmp / f"{stage.name}.onnx"
        export_stage(stage, path, 64, 64)
        out[stage.name] = (stage, path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))
    return out


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    return export_all(scorer_stages(*models, BUDGET, TOPM, K), tmp_path_factory.mktemp("scorer"))


def assert_outputs_match(got, want):
    for g, w in zip(got, want):
        w = w.numpy()
        assert g.shape == w.shape and g.dtype == w.dtype
        if np.issubdtype(w.dtype, np.floating):
            assert np.allclose(g, w, atol=1e-5, rtol=0), float(np.abs(g - w).max())
        else:
            assert np.array_equal(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPS))
def test_exported_stage_matches_torch(exported, name):
    stage, path, sess = exported[name]
    model = onnx.load(str(path), load_external_data=False)
    used = {n.op_type for n in model.graph.node if n.domain == "dtrt"}
    assert used == OPS[name]
    assert {(f.domain, f.name) for f in model.functions} == {("dtrt", op) for op in OPS[name]}
    for n in (1, 3, 9) if name != "frontier" else (1, 3):
        example = stage.example(n, 0, torch.Generator().manual_seed(n))
        with torch.no_grad():
            want = stage.module(*[example[k] for k in stage.inputs])
        got = sess.run(stage.outputs, {k: v.numpy() for k, v in example.items()})
        assert_outputs_match(got, want if isinstance(want, tuple) else (want,))


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2, None])
def test_setup_is_the_domino_scorers_round_precompute(models, exported, rows):
    """Over the rows a round's block computed (None: every one, k_draft)."""
    target, drafter = models
    stage, _, sess = exported["scorer_setup"]
    rnd = random_round(1, rows or drafter.cfg.k_draft, drafter.cfg.hidden_size, drafter.cfg.vocab_size, seed=4)
    sc = DominoScorer(rnd, drafter.head, target.model.embed_tokens, K, TOPM, 1)
    cand, basec, zproj, w2c = sess.run(None, {"ph": rnd.ph[0].numpy(), "base": rnd.base[0].numpy()})
    assert np.array_equal(cand, sc.cand[0].numpy())
    for got, want in ((basec, sc.basec), (zproj, sc.zp), (w2c, sc.w2c)):
        assert np.allclose(got, want[0].numpy(), atol=1e-6, rtol=0)


def session_runner(sessions):
    """`run(stage, **feeds)` over bare InferenceSessions, as a StageRunner calls the exported scorer stages."""

    def run(stage, **feeds):
        sess = sessions[stage.removeprefix("domino.")]
        outs = sess.run(None, {k: np.ascontiguousarray(torch.as_tensor(v).numpy()) for k, v in feeds.items()})
        return {o.name: torch.from_numpy(a) for o, a in zip(sess.get_outputs(), outs)}

    return run


def assert_same_tree(a, b):
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.scores, b.scores, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_heap_on_onnxruntime_scorer_is_the_torch_heap(models, exported, prefix_len):
    target, drafter = models
    sessions = {name: sess for name, (_, _, sess) in exported.items()}
    D = drafter.cfg.k_draft
    for seed, budget in ((0, 5), (1, 12), (2, 30)):
        rnd = random_round(1, D, drafter.cfg.hidden_size, drafter.cfg.vocab_size, seed=seed)
        want = build_heap(DominoScorer(rnd, drafter.head, target.model.embed_tokens, K, TOPM, prefix_len), budget, D)
        got = build_heap(StageDominoScorer(session_runner(sessions), rnd, K, prefix_len, TOPM), budget, D)
        assert len(got) == budget + 1
        assert_same_tree(got, want)


@pytest.mark.parametrize("budget, want", [(1, []), (2, ["setup", "root", "advance", "children"])])
def test_the_scorer_stages_run_when_the_heap_needs_them(models, exported, budget, want):
    """A budget-1 tree (prefix_len 1) is the base marginal's best draft: no scorer stage runs; at budget 2 each stage
    runs once, the advance for the one node expanded."""
    target, drafter = models
    sessions = {name: sess for name, (_, _, sess) in exported.items()}
    run, calls = session_runner(sessions), []

    def counting(stage, **feeds):
        calls.append((stage.removeprefix("domino.scorer_"), len(feeds.get("tokens", [0]))))
        return run(stage, **feeds)

    rnd = random_round(1, budget, drafter.cfg.hidden_size, drafter.cfg.vocab_size, seed=5)
    got = build_heap(StageDominoScorer(counting, rnd, K, 1, TOPM), budget, budget)
    want_tree = build_heap(DominoScorer(rnd, drafter.head, target.model.embed_tokens, K, TOPM, 1), budget, budget)
    assert_same_tree(got, want_tree)
    assert sorted(name for name, _ in calls) == sorted(want)
    assert all(rows == 1 for name, rows in calls if name == "advance")


@pytest.mark.slow
def test_heap_on_onnxruntime_scorer_over_the_full_vocabulary(models, exported, tmp_path):
    """topm = 0: the split stages take M = V candidates."""
    target, drafter = models
    stages = {s.name: s for s in scorer_stages(target, drafter, BUDGET, 0, K)}
    full = export_all([stages["scorer_setup"], stages["scorer_children"]], tmp_path)
    sessions = {name: sess for name, (_, _, sess) in {**exported, **full}.items()}
    assert full["scorer_setup"][2].get_outputs()[0].shape == ["R", drafter.cfg.vocab_size]
    D = drafter.cfg.k_draft
    for seed in range(3):
        rnd = random_round(1, D, drafter.cfg.hidden_size, drafter.cfg.vocab_size, seed=seed)
        want = build_heap(DominoScorer(rnd, drafter.head, target.model.embed_tokens, K, 0, 1), BUDGET, D)
        assert_same_tree(build_heap(StageDominoScorer(session_runner(sessions), rnd, K, 1, 0), BUDGET, D), want)


def frontier_matches(models, stage, sess, budget, k, topm):
    target, drafter = models
    cfg = drafter.cfg
    for bs, seed in ((1, 0), (3, 1)):
        rnd = random_round(bs, cfg.k_draft, cfg.hidden_size, cfg.vocab_size, seed=seed)
        scorer = DominoScorer(rnd, drafter.head, target.model.embed_tokens, k, topm, cfg.pure_draft_prefix_len)
        want = build_frontier(scorer, budget, cfg.k_draft, cfg.mask_token_id)
        got = sess.run(stage.outputs, {"ph": rnd.ph.numpy(), "base": rnd.base.numpy(), "root": rnd.root.numpy()})
        assert_same_tree(type(want)(*map(torch.from_numpy, got)), want)
        assert bool(torch.isfinite(want.scores).all())


@pytest.mark.slow
def test_exported_frontier_is_build_frontier(models, exported):
    stage, _, sess = exported["frontier"]
    frontier_matches(models, stage, sess, BUDGET, K, TOPM)


@pytest.mark.slow
def test_exported_frontier_with_fewer_lanes_than_children(models, tmp_path):
    """budget 3 < node_topk 4 = M, so each keep step drops part of an expansion; a 4-deep block whose first two
    depths are the base marginal."""
    target, _ = models
    cfg = drafter_json(hidden=target.cfg.hidden_size, vocab=target.cfg.vocab_size, block=4, domino=True)
    cfg["dflash_config"]["pure_draft_prefix_len"] = 2
    drafter = load_drafter(write_drafter(tmp_path / "drafter", cfg, gru=8, emb=16))
    stage = next(s for s in scorer_stages(target, drafter, 3, K, K) if s.name == "frontier")
    path = tmp_path / "frontier.onnx"
    export_stage(stage, path, 64, 64)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    frontier_matches((target, drafter), stage, sess, 3, K, K)


def test_scorer_stages_need_a_head(models):
    target, drafter = models
    head, drafter.head = drafter.head, None
    try:
        with pytest.raises(ValueError, match="Domino head"):
            scorer_stages(target, drafter, BUDGET, TOPM, K)
    finally:
        drafter.head = head

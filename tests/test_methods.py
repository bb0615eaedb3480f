"""Every method gives exactly the AR tokens at T=0 on the tiny pair, whose drafts really get accepted."""

import json
import sys

import pytest

from dtrt import cli
from dtrt.runtime.calibrate import measure_cost_curve
from dtrt.runtime.methods import DraftConfig
from dtrt.runtime.pipeline import build_pipeline
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import CostCurve

PROMPTS = ["The cat sees ", "A quick fox ", "Every king walks ", "The moon is very ", "Some old man reads "]
VARIANTS = [
    DraftConfig("dflash"),
    DraftConfig("domino"),
    DraftConfig("ddtree"),
    DraftConfig("caddtree", budget=32),
    DraftConfig("dominotree"),
    DraftConfig("dominotree", builder="frontier"),
    DraftConfig("dominotree", arm="condstatic"),
    DraftConfig("dominotree", arm="marg", builder="frontier"),
    DraftConfig("dominotree", budget=4, node_topk=2, topm=0),
    DraftConfig("cadominotree", budget=32),
]


def generate_all(pipe, max_new=64):
    ids = [pipe.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return [pipe.generate(i, max_new, SamplingConfig()) for i in ids]


@pytest.fixture(scope="module")
def ar_tokens(tiny):
    return [g.tokens for g in generate_all(build_pipeline(tiny, DraftConfig("ar")))]


@pytest.mark.parametrize("draft", VARIANTS, ids=lambda d: f"{d.method}-{d.builder}-{d.arm}-b{d.budget}")
def test_exact_ar_tokens_with_accepted_drafts(tiny, ar_tokens, draft):
    pipe = build_pipeline(tiny, draft)
    if draft.method in ("caddtree", "cadominotree"):  # a fixed cost curve: a measured one varies with load
        pipe.method.curve = LINEAR_COST
    gens = generate_all(pipe)
    assert [g.tokens for g in gens] == ar_tokens
    rounds = [r for g in gens for r in g.rounds]
    mean_accepted = sum(r.accepted for r in rounds) / len(rounds)
    assert mean_accepted > 2, mean_accepted
    depth = pipe.backend.drafter.cfg.k_draft
    kinds = {
        "zero" if r.accepted == 1 else "full" if r.accepted == min(depth, draft.budget) + 1 else "partial"
        for r in rounds
    }
    assert kinds == {"zero", "partial", "full"}, kinds
    assert all(r.tree_size <= draft.budget + 1 for r in rounds)


LINEAR_COST = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)


@pytest.mark.parametrize("method", ["caddtree", "cadominotree"])
def test_cost_aware_methods_measure_their_cost_curve_and_adapt_the_budget(tiny, method):
    pipe = build_pipeline(tiny, DraftConfig(method, budget=32))
    ids = pipe.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    pipe.generate(ids, 4, SamplingConfig())
    curve = pipe.method.curve  # measured on this backend during the first generation
    costs = [curve.verify_cost(n, 20) for n in (0, 4, 16, 32)]
    assert costs == sorted(costs) and costs[0] > 0 and curve.draft_cost > 0
    sizes = {}
    for name, c in (
        ("cheap", CostCurve.fit({0: [(0, 1.0), (32, 1.1)]}, 0.1)),
        ("steep", CostCurve.fit({0: [(0, 1.0), (32, 33.0)]}, 0.1)),
    ):
        pipe.method.curve = c
        sizes[name] = [r.tree_size for r in pipe.generate(ids, 48, SamplingConfig()).rounds]
    assert max(sizes["steep"]) < min(sizes["cheap"]), sizes
    assert max(sizes["cheap"]) <= 33
    assert measure_cost_curve(pipe.backend, 8).contexts[0] >= len(ids)


def test_tree_methods_beat_chains(tiny):
    tau = {}
    for d in (DraftConfig("dflash"), DraftConfig("dominotree")):
        gens = generate_all(build_pipeline(tiny, d))
        tau[d.method] = sum(g.tau for g in gens) / len(gens)
    assert tau["dominotree"] > tau["dflash"], tau


def test_eos_and_max_new_tokens(tiny):
    pipe = build_pipeline(tiny, DraftConfig("dominotree"))
    ids = pipe.tokenizer.encode("The cat ", add_special_tokens=False)
    for n in (1, 2, 5, 17):
        assert len(pipe.generate(ids, n, SamplingConfig()).tokens) == n
    full = pipe.generate(ids, 40, SamplingConfig()).tokens
    pipe.eos = (full[10],)
    stopped = pipe.generate(ids, 40, SamplingConfig())
    cut = full.index(full[10]) + 1
    assert stopped.tokens == full[:cut] and stopped.stop_reason == "eos"


def test_cli_run_text_and_json(tiny, monkeypatch, capsys):
    argv = ["dtrt", "run", "--model", "tiny", "--method", "dominotree", "--budget", "16", "The cat sees "]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    out = capsys.readouterr()
    assert len(out.out.strip()) > 20 and "tau" in out.err and "tok/s" in out.err
    monkeypatch.setattr(sys, "argv", argv + ["--json"])
    cli.main()
    res = json.loads(capsys.readouterr().out)
    assert {"tokens", "text", "tau", "tokens_per_s", "rounds"} <= res.keys()
    assert res["tau"] > 2 and len(res["tokens"]) == 128 and res["text"] == out.out.strip("\n")

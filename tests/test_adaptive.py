"""cadominotree's adaptive budget: the calibrated acceptance map, the per-node cost, the stopping rule that never
admits a node its own model says does not pay, and the root alone (no drafter call) where nothing pays; the tokens
stay the AR tokens."""

import math

import pytest
from helpers import PROMPTS, pipe_for, spec

from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import CostCurve
from dtrt.tree.adaptive import (
    LOGW_EDGES,
    SCALE_RANGE,
    AcceptanceMap,
    AdaptiveStop,
    NodeCost,
    RoundClock,
    SpeculationGate,
    TreeEstimate,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_acceptance_map_starts_at_the_raw_score_and_learns():
    m = AcceptanceMap()
    assert m(-0.05) == pytest.approx(math.exp(-0.05), abs=0.05)
    assert m(-3.5) == pytest.approx(math.exp(-3.75), abs=0.01)
    # the drafter is overconfident: nodes scored near 1 are accepted 30% of the time
    for i in range(200):
        m.observe([0.0, -0.05], {0, 1} if i % 10 < 3 else {0})
    assert m(-0.05) == pytest.approx(0.3, abs=0.02)
    # a worse bin that happens to look better is pooled with it: a better score never maps lower
    for _ in range(50):
        m.observe([0.0, -0.7], {0, 1})
    rates = m.rates()
    assert all(a >= b for a, b in zip(rates, rates[1:])), rates
    assert len(rates) == len(LOGW_EDGES) + 1


def test_the_node_cost_is_the_slope_of_build_time():
    c = NodeCost()
    assert c.per_node == 0.0
    c.observe(8, 0.004)
    assert c.per_node == pytest.approx(0.0005)  # one size seen: the mean
    for n in (2, 5, 9, 14, 3, 16, 7):
        c.observe(n, 0.001 + 0.0002 * n)
    c2 = NodeCost()
    for n in (2, 5, 9, 14, 3, 16, 7):
        c2.observe(n, 0.001 + 0.0002 * n)
    assert c2.per_node == pytest.approx(0.0002, rel=1e-6)


def test_the_stop_never_admits_a_node_that_does_not_pay():
    curve = CostCurve.fit({0: [(0, 0.010), (4, 0.011), (16, 0.020), (32, 0.045)]}, 0.004)
    acceptance = AcceptanceMap()
    for i in range(100):
        acceptance.observe([0.0, -0.05, -0.3, -1.5], {0, 1} | ({2} if i % 2 else set()))
    stop = AdaptiveStop(curve, 100, acceptance, draft_s=0.004, node_s=0.0003)
    scores = [-0.02 * i for i in range(1, 6)] + [-0.4 - 0.3 * i for i in range(30)]

    def theta(n):  # the model, written out
        gain = 1 + sum(acceptance(w) for w in scores[:n])
        return gain / (0.004 + 0.0003 * n + curve.verify_cost(n, 100))

    stop.start()
    n = 0
    while n < len(scores) and stop.admit(n, scores[n]):
        n += 1
    assert 0 < n < len(scores)
    assert all(theta(k) > theta(k - 1) for k in range(1, n + 1))
    assert theta(n + 1) <= theta(n)
    assert stop.theta == pytest.approx(theta(n))


def test_the_gate_drafts_while_trees_pay_and_probes_otherwise():
    """Probes that find nothing that pays come half as often each time, up to the gate's limit; one that pays
    brings the first interval back."""
    gate, clock = SpeculationGate(probe=4, max_probe=16), RoundClock()
    root = 0.010  # a root-alone round: 100 tokens/s
    assert gate.drafts(clock, root)  # nothing known yet
    poor = TreeEstimate(gain=1.0, own_s=0.008, verify_s=0.012)  # 50 tokens/s
    gate.observe_tree(poor)

    def rounds(n, probe_tree):
        decisions = []
        for _ in range(n):
            decisions.append(gate.drafts(clock, root))
            if decisions[-1]:  # the probe round's tree
                gate.observe_tree(probe_tree)
        return decisions

    probes = [i for i, d in enumerate(rounds(4 + 8 + 16 + 16, poor)) if d]
    assert probes == [3, 11, 27, 43]  # every 4th round, then 8th, then 16th, and no further apart
    good = TreeEstimate(gain=10.0, own_s=0.004, verify_s=0.016)  # 500 tokens/s
    assert [i for i, d in enumerate(rounds(16, good)) if d] == [15]  # a probe that pays ...
    assert gate.interval == 4 and gate.drafts(clock, root)  # ... and the trees drafted now pay on average
    gate.observe_tree(good)
    assert gate.drafts(clock, root)
    for _ in range(20):  # the trees stop paying: probes resume at the first interval
        gate.observe_tree(poor)
    assert [i for i, d in enumerate(rounds(8, poor)) if d] == [3]


def test_the_clock_prices_what_the_curve_leaves_out():
    """A round's fixed seconds (commit, the drafter's context, the loop) and the loop's verify over the curve's,
    learnt from the rounds: they make a root-alone round dearer, and a tree kept by the gate is priced again by
    the clock of now, not the one it was built under."""
    clock = RoundClock()
    assert clock.round_cost(0.010) == 0.010  # nothing learnt: the curve as measured
    clock.observe_rest(0.004)
    clock.observe_verify(0.012, 0.010)
    assert clock.overhead == pytest.approx(0.004) and clock.scale == pytest.approx(1.2)
    for _ in range(100):
        clock.observe_rest(0.002)
        clock.observe_verify(0.013, 0.010)
    assert clock.overhead == pytest.approx(0.002, rel=1e-3) and clock.scale == pytest.approx(1.3, rel=1e-3)
    clock.observe_verify(1.0, 0.010)  # a stall, or a curve of another machine: the correction stays bounded
    assert clock.scale <= 0.9 * 1.3 + 0.1 * SCALE_RANGE[1] + 1e-9
    tree = TreeEstimate(gain=1.4, own_s=0.004, verify_s=0.011)
    bare, learnt = RoundClock(), RoundClock(overhead=0.006, scale=1.2)
    # apart from the curve a 1.4-token tree loses to the root alone; with the round's fixed costs it wins
    assert tree.theta(bare) < 1 / bare.round_cost(0.010) and tree.theta(learnt) > 1 / learnt.round_cost(0.010)
    gate = SpeculationGate()
    gate.observe_tree(tree)
    assert not gate.drafts(bare, 0.010) and gate.drafts(learnt, 0.010)


NOTHING_PAYS = CostCurve.fit({0: [(0, 1.0), (32, 200.0)]}, draft_cost=2.0)
CHEAP = CostCurve.fit({0: [(0, 1.0), (32, 1.1)]}, draft_cost=0.05)


def counted(pipe):
    calls = []
    draft_block = pipe.backend.draft_block

    def counting(*a, **kw):
        calls.append(1)
        return draft_block(*a, **kw)

    pipe.backend.draft_block = counting
    return calls


def test_the_root_alone_where_nothing_pays(tiny):
    ar = pipe_for(tiny, spec("ar"))
    ids = ar.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    expected = ar.generate(ids, 60, SamplingConfig()).tokens
    pipe = pipe_for(tiny, spec("cadominotree", budget=16))
    pipe.method.curve = NOTHING_PAYS
    calls = counted(pipe)
    g = pipe.generate(ids, 60, SamplingConfig())
    assert g.tokens == expected
    assert all(r.tree_size == 1 for r in g.rounds)  # not even a first node pays
    assert len(calls) <= len(g.rounds) // pipe.method.gate.probe + 1
    assert pipe.method.acceptance.offered == [0.0] * (len(LOGW_EDGES) + 1)  # no node was ever verified


def test_the_tree_grows_where_it_pays_and_the_map_learns(tiny):
    ar = pipe_for(tiny, spec("ar"))
    ids = ar.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    expected = ar.generate(ids, 60, SamplingConfig()).tokens
    pipe = pipe_for(tiny, spec("cadominotree", budget=16))
    pipe.method.curve = CHEAP
    calls = counted(pipe)
    built = []  # (nodes, seconds) as the node cost saw them; their slope is a timing, not asserted here
    observe = pipe.method.node_cost.observe
    pipe.method.node_cost.observe = lambda nodes, seconds: (built.append((nodes, seconds)), observe(nodes, seconds))
    g = pipe.generate(ids, 60, SamplingConfig())
    assert g.tokens == expected and g.tau > 2
    assert len(calls) == len(g.rounds)  # every round drafts
    assert max(r.tree_size for r in g.rounds) > 8
    verified = sum(r.tree_size - 1 for r in g.rounds)
    assert sum(pipe.method.acceptance.offered) == verified
    assert sum(pipe.method.acceptance.accepted) == sum(r.accepted - 1 for r in g.rounds)
    assert [n for n, _ in built] == [r.tree_size - 1 for r in g.rounds] and all(s > 0 for _, s in built)
    assert pipe.method.node_cost.per_node >= 0 and pipe.method.draft_s != CHEAP.draft_cost


def test_the_cost_aware_budget_is_a_cap_not_the_fixed_budget():
    from dtrt.launch import resolve_spec

    assert resolve_spec(model="smollm2-135m", method="dominotree", backend="onnxruntime").budget == 2  # gguf: fixed
    assert resolve_spec(model="smollm2-135m", method="dominotree", backend="onnxruntime", quant="none").budget == 4
    assert resolve_spec(model="smollm2-135m", method="dominotree", backend="onnxruntime", quant="int8").budget == 2
    int8_alone = resolve_spec(model="smollm2-135m", method="dominotree", quant="int8", lookup=False)
    assert int8_alone.budget == 1
    assert resolve_spec(model="smollm2-135m", method="cadominotree", backend="onnxruntime").budget == 16
    assert resolve_spec(model="smollm2-135m", method="caddtree", quant="none").budget == 16
    assert resolve_spec(model="smollm2-135m", method="cadominotree", budget=8).budget == 8

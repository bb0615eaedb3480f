import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrt.tree import CostAwareStop, CostCurve, build_ddtree


def paths(tree) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


@settings(max_examples=80, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), depth=st.integers(1, 3), vocab=st.integers(1, 5), budget=st.integers(1, 60))
def test_ddtree_is_the_top_prefixes_of_the_product_of_marginals(seed, depth, vocab, budget):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(2 * torch.randn(depth, vocab, generator=g), -1)
    lp = logprobs.double().tolist()
    prefixes = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    prefixes.sort(key=lambda p: -sum(lp[d][t] for d, t in enumerate(p)))
    best = prefixes[:budget]
    tree = build_ddtree(logprobs, budget)
    assert len(tree) == 1 + len(best)
    assert set(paths(tree)) == set(best)
    expected = torch.tensor([sum(lp[d][t] for d, t in enumerate(p)) for p in paths(tree)], dtype=torch.float64)
    assert torch.allclose(tree.scores[1:].double(), expected, atol=1e-5)


def test_ddtree_ties_go_to_the_smaller_rank_tuple():
    # two equally likely tokens at each depth: the prefix of rank tuple (0, 0) precedes (0, 1), (1,)...
    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    tree = build_ddtree(logprobs, 6)
    top = torch.topk(logprobs, 3, dim=-1).indices.tolist()
    a, b = top[0][0], top[0][1]
    c, d = top[1][0], top[1][1]
    assert paths(tree) == [(a,), (b,), (a, c), (a, d), (b, c), (b, d)]


def test_ddtree_edges():
    assert len(build_ddtree(torch.zeros(0, 5), 4)) == 1
    assert len(build_ddtree(torch.log_softmax(torch.randn(3, 5), -1), 0)) == 1
    t = build_ddtree(torch.log_softmax(torch.randn(2, 3), -1), 100, root=7)
    assert len(t) == 1 + 3 + 9 and t.tokens[0] == 7


def linear_curve(slope: float, draft: float = 1.0) -> CostCurve:
    return CostCurve.fit({0: [(n, 1.0 + slope * n) for n in range(0, 9)]}, draft)


@pytest.mark.parametrize("slope,nodes", [(0.5, 1), (0.25, 2), (0.1, 3)])
def test_cost_aware_stop_by_hand(slope, nodes):
    # C_d = 1, C_v(n) = 1 + slope * n; one depth with probabilities 0.6, 0.3, 0.1, so θ(0) = 1/2 and
    #   slope 0.5:  θ(1) = 1.6/2.5  = 0.64  > 0.5;   θ(2) = 1.9/3.0  = 0.633 <= 0.64   -> 1 node
    #   slope 0.25: θ(1) = 1.6/2.25 = 0.711; θ(2) = 1.9/2.5 = 0.76;  θ(3) = 2.0/2.75 = 0.727  -> 2 nodes
    #   slope 0.1:  θ(1) = 0.762;  θ(2) = 0.864;  θ(3) = 2.0/2.3 = 0.870                    -> 3 nodes
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    tree = build_ddtree(logprobs, 10, CostAwareStop(linear_curve(slope), context_len=0))
    assert tree.num_nodes == nodes
    assert tree.tokens[1:].tolist() == [0, 1, 2][:nodes]


def test_cost_aware_stop_state():
    stop = CostAwareStop(linear_curve(0.25), context_len=0)
    stop.start()
    assert stop.theta == pytest.approx(0.5)
    assert stop.admit(0, math.log(0.6)) and stop.theta == pytest.approx(1.6 / 2.25) and stop.phi == pytest.approx(0.6)
    assert stop.admit(1, math.log(0.3)) and stop.theta == pytest.approx(0.76)
    assert not stop.admit(2, math.log(0.1))
    assert stop.phi == pytest.approx(0.9)  # a refused candidate leaves the state alone
    stop.start()
    assert stop.phi == 0.0 and stop.theta == pytest.approx(0.5)


def test_cost_aware_stop_with_budget_cap():
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    assert build_ddtree(logprobs, 2, CostAwareStop(linear_curve(0.0), context_len=0)).num_nodes == 2


def test_cost_curve_interpolation_and_extrapolation():
    curve = CostCurve.fit(
        {0: [(n, 1.0 + 0.01 * n) for n in range(0, 101, 10)], 1000: [(n, 2.0 + 0.02 * n) for n in range(0, 101, 25)]},
        draft_cost=0.5,
    )
    assert curve.draft_cost == 0.5
    assert curve.verify_cost(50, 0) == pytest.approx(1.5)
    assert curve.verify_cost(55, 0) == pytest.approx(1.55)
    assert curve.verify_cost(50, 500) == pytest.approx((1.5 + 3.0) / 2)
    assert curve.verify_cost(50, 250) == pytest.approx(0.75 * 1.5 + 0.25 * 3.0)
    assert curve.verify_cost(200, 0) == pytest.approx(3.0)  # past the last knot: the last slope continues
    assert curve.verify_cost(200, 1000) == pytest.approx(6.0)
    # past the last context the cost keeps growing as between the last two; below the first it is flat
    assert curve.verify_cost(50, 2000) == pytest.approx(4.5)
    assert curve.verify_cost(200, 3000) == pytest.approx(6.0 + 2 * 3.0)
    assert curve.verify_cost(50, -10) == curve.verify_cost(50, 0)


def test_cost_curve_never_gets_cheaper_past_its_last_context():
    curve = CostCurve.fit({0: [(0, 2.0), (8, 3.0)], 100: [(0, 1.0), (8, 2.0)]}, draft_cost=0.0)  # a noisy far read
    assert curve.verify_cost(8, 1000) == curve.verify_cost(8, 100) == pytest.approx(2.0)
    assert CostCurve.fit({7: [(0, 1.0)]}, 0.0).verify_cost(0, 9000) == 1.0  # one context: flat in it


def test_cost_curve_json_round_trip():
    curve = CostCurve.fit({0: [(0, 1.0), (4, 2.0)], 512: [(0, 1.5), (4, 3.0)]}, draft_cost=0.25)
    again = CostCurve.from_json(json.loads(json.dumps(curve.to_json())))
    assert again == curve
    for bad in ({}, {**curve.to_json(), "draft_cost": -1.0}, {**curve.to_json(), "seconds": [[1.0, "x"], [1.0]]}):
        with pytest.raises(ValueError):
            CostCurve.from_json(bad)
    with pytest.raises(ValueError):
        CostCurve.from_json({**curve.to_json(), "seconds": [[1.0, float("nan")], [1.5, 3.0]]})


def test_cost_curve_fit_by_hand():
    # isotonic: 1, 3, 2, 4 -> 1, 2.5, 2.5, 4; lower hull drops (1, 2.5): knots (0, 1), (2, 2.5), (3, 4)
    curve = CostCurve.fit({0: [(0, 1.0), (1, 3.0), (2, 2.0), (3, 4.0)]}, draft_cost=0.0)
    assert curve.nodes == [[0.0, 2.0, 3.0]] and curve.seconds == [[1.0, 2.5, 4.0]]
    assert curve.verify_cost(1, 0) == pytest.approx(1.75)
    # repeated measurements reduce to their median
    curve = CostCurve.fit({0: [(4, 1.0), (4, 1.0), (4, 100.0), (8, 2.0)]}, draft_cost=0.0)
    assert curve.seconds == [[1.0, 2.0]]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), points=st.integers(1, 30))
def test_cost_curve_is_monotone_and_convex(seed, points):
    g = torch.Generator().manual_seed(seed)
    ns = sorted(set((torch.rand(points, generator=g) * 512).long().tolist()))
    noisy = [(n, 1e-3 * (1 + n / 64) ** 1.5 + 2e-4 * torch.randn(1, generator=g).item()) for n in ns]
    curve = CostCurve.fit({0: noisy, 2048: [(n, 2 * t) for n, t in noisy]}, draft_cost=1e-3)
    for ctx in (0, 1000, 2048):
        values = [curve.verify_cost(n, ctx) for n in range(0, 700, 7)]
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))
        slopes = [b - a for a, b in zip(values, values[1:])]
        assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))


def test_cost_curve_rejects_bad_input():
    with pytest.raises(ValueError):
        CostCurve([], [], [], 0.0)
    with pytest.raises(ValueError):
        CostCurve([1, 0], [[0.0], [0.0]], [[1.0], [1.0]], 0.0)
    with pytest.raises(ValueError):
        CostCurve.fit({0: []}, 0.0)

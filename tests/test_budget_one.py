"""A budget-1 DominoTree round is built from the block's first row alone (dtrt.tree.best_marginal_child): the same
tree, score included, as build_heap's over any scorer whose depth 0 takes the base marginal, ties and draft
vocabularies included, and, round by round in the decode loop, the same trees and tokens as the scorer and heap."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from helpers import generate_all, pipe_for, spec
from test_tree_builders import V, make_model, make_round, make_scorer

from dtrt.runtime import methods
from dtrt.tree import CostCurve, Round, best_marginal_child, build_heap
from dtrt.tree.lookup_scorer import LookupScorer, Trie

pytestmark = pytest.mark.usefixtures("one_thread")


def same_tree(a, b):
    for field in ("tokens", "parents", "depths", "scores", "mask"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), f"{field}: {x} != {y}"


def tied_round(seed: int, ids: torch.Tensor | None = None) -> Round:
    """Integer base logits over few values: many columns share the best log-prob."""
    g = torch.Generator().manual_seed(seed)
    columns = V if ids is None else len(ids)
    logits = torch.randint(0, 3, (1, 4, columns), generator=g).float()
    ph = torch.randn(1, 4, 12, generator=g)
    return Round(ph, logits, torch.tensor([5]), ids, V if ids is not None else None)


@pytest.mark.parametrize("kind", ["marginal", "dominotree", "condstatic"])
@pytest.mark.parametrize("k, topm", [(1, 8), (4, 8), (8, 3), (4, 0)])
def test_the_first_row_gives_the_heaps_budget_one_tree(kind, k, topm):
    model = make_model(seed=3)
    subset = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40].tolist()))
    for seed, ids, tied in itertools.product(range(6), (None, subset), (False, True)):
        rnd = tied_round(seed, ids) if tied else make_round(1, 4, seed=seed)
        if ids is not None and not tied:
            rnd = Round(rnd.ph, rnd.logits[..., ids], rnd.root, ids, V)
        heap = build_heap(make_scorer(kind, rnd, model, k, topm, prefix_len=1), 1, 4)
        width = k if kind == "marginal" else min(k, topm or V)
        fast = best_marginal_child(rnd.logits[0, 0], int(rnd.root[0]), width, ids)
        same_tree(fast, heap)
        assert len(fast) == 2


def test_ties_take_the_heaps_first_pop_not_the_lowest_id():
    """On ties the heap pops top-k's first, which need not be the lowest column: so does the budget-1 tree."""
    differs = 0
    for seed in range(40):
        rnd = tied_round(seed)
        fast = best_marginal_child(rnd.logits[0, 0], 5, 4)
        same_tree(fast, build_heap(make_scorer("marginal", rnd, None, 4), 1, 4))
        differs += int(fast.tokens[1]) != int(rnd.logits[0, 0].argmax())
    assert differs > 0  # the case is exercised


def test_a_stop_starts_and_admits_the_one_node():
    class Stop:
        def __init__(self, admit):
            self.admit_it, self.seen, self.started = admit, [], 0

        def start(self):
            self.started += 1

        def admit(self, n_nodes, logw):
            self.seen.append((n_nodes, logw))
            return self.admit_it

    rnd = make_round(1, 4, seed=2)
    for admit in (True, False):
        fast_stop, heap_stop = Stop(admit), Stop(admit)
        fast = best_marginal_child(rnd.logits[0, 0], int(rnd.root[0]), 4, stop=fast_stop)
        heap = build_heap(make_scorer("marginal", rnd, None, 4), 1, 4, heap_stop)
        same_tree(fast, heap)
        assert fast_stop.started == heap_stop.started == 1 and fast_stop.seen == heap_stop.seen
        assert len(fast) == (2 if admit else 1)


@pytest.mark.parametrize("kind", ["marginal", "dominotree"])
def test_lookups_next_tokens_join_the_first_row_as_in_the_lookup_scorer(kind):
    """Lookup's next tokens: one of the drafter's children (its better score kept) or added after them; on ties
    the drafter's child, pushed first, is popped."""
    model = make_model(seed=4)
    subset = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:40].tolist()))
    seen = set()
    for seed, ids in itertools.product(range(8), (None, subset)):
        rnd = tied_round(seed, ids) if seed % 2 else make_round(1, 4, seed=seed)
        if ids is not None and seed % 2 == 0:
            rnd = Round(rnd.ph, rnd.logits[..., ids], rnd.root, ids, V)
        inner = make_scorer(kind, rnd, model, 4, 8, prefix_len=1)
        best = inner.children(torch.zeros(1, 1, 1), 0)
        top, top_lp = best[0][0, 0].tolist(), best[1][0, 0].tolist()
        outside = next(t for t in (ids.tolist() if ids is not None else range(V)) if t not in top)
        for chain, log_accept in (
            ((top[1],), top_lp[0] + 0.5),  # a drafter child, its score raised past the best
            ((top[2],), top_lp[2] - 1.0),  # a drafter child, its own score kept
            ((outside,), top_lp[0]),  # added after the children at the best's score: the drafter's child wins
            ((outside,), top_lp[0] + 0.1),  # added, and best
            ((outside, top[0]), -0.3),  # two chains
        ):
            trie = Trie()
            for t in chain:
                trie.children[0][t] = len(trie.children)
                trie.children.append({})
            scorer = LookupScorer(make_scorer(kind, rnd, model, 4, 8, prefix_len=1), trie, [log_accept] * 4)
            heap = build_heap(scorer, 1, 4)
            fast = best_marginal_child(rnd.logits[0, 0], int(rnd.root[0]), 4, ids, None, chain, log_accept)
            same_tree(fast, heap)
            seen.add(int(fast.tokens[1]) in chain)
    assert seen == {True, False}


def fake_clock():
    ticks = itertools.count()
    return SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3)


def rounds_of(pair, draft, backend, export, generic: bool, monkeypatch):
    """(tokens per prompt, every round's tree, accepted per round, rounds built by best_marginal_child);
    `generic`: the Round, scorer and heap build every tree."""
    monkeypatch.setattr(methods, "time", fake_clock())
    if generic:
        monkeypatch.setattr(methods.DominoTree, "one_marginal_child", lambda self, backend: False)
    fast = []  # per round built by best_marginal_child: whether lookup's next tokens joined it

    def counted(logits, root, k, ids, stop, chain=(), log_accept=0.0):
        fast.append(bool(chain))
        return best_marginal_child(logits, root, k, ids, stop, chain, log_accept)

    monkeypatch.setattr(methods, "best_marginal_child", counted)
    pipe = pipe_for(pair, draft, backend=backend, export=export, threads=1 if backend == "onnxruntime" else None)
    if draft.method.startswith("ca"):
        pipe.method.curve = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)
    trees, real = [], pipe.method.draft

    def draft_and_keep(backend, root, start):
        tree, t = real(backend, root, start)
        trees.append(tree)
        return tree, t

    pipe.method.draft = draft_and_keep
    gens = generate_all(pipe)
    return [g.tokens for g in gens], trees, [r.accepted for g in gens for r in g.rounds], fast


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "onnxruntime-int4"])
@pytest.mark.parametrize(
    "draft",
    [
        spec("dominotree", budget=1),
        spec("dominotree", budget=1, arm="marg"),
        spec("cadominotree", budget=1),
        spec("dominotree", budget=1, lookup=True),
        spec("cadominotree", budget=1, lookup=True),
    ],
    ids=lambda d: f"{d.method}-{d.arm}" + ("-lookup" if d.lookup else ""),
)
def test_budget_one_rounds_are_those_of_the_scorer_and_heap(
    request, tiny, tiny_export, torch_tokens, draft, backend, monkeypatch
):
    exp = request.getfixturevalue("tiny_export_int4") if backend.endswith("int4") else tiny_export
    pair, export = (tiny, None) if backend == "torch" else (None, exp.path)
    backend = backend.partition("-")[0]
    generic_tokens, generic_trees, _, none = rounds_of(pair, draft, backend, export, True, monkeypatch)
    monkeypatch.undo()
    tokens, trees, accepted, fast = rounds_of(pair, draft, backend, export, False, monkeypatch)
    assert none == [] and len(fast) == len(trees)  # every drafted round took the one path, then the other
    if draft.lookup:
        assert any(fast)  # lookup's next tokens joined some rounds
    assert tokens == generic_tokens == torch_tokens
    assert len(trees) == len(generic_trees) > 0
    for a, b in zip(trees, generic_trees):
        same_tree(a, b)
    assert any(a > 1 for a in accepted)  # drafts were accepted

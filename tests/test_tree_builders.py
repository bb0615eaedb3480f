import copy

import pytest
import torch
from helpers import no_host_sync
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dtrt.models.domino import DominoHead
from dtrt.scoring import CondStaticScorer, DominoScorer
from dtrt.tree import MarginalScorer, Round, Tree, build_ddtree, build_frontier, build_heap

V, H, G, E = 89, 12, 10, 24
MASK = 88
DOMINO_CONFIGS = [(8, 1), (8, 0), (0, 0), (0, 2), (3, 5)]  # (topm, prefix_len)


def make_model(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    head = DominoHead(hidden=H, gru_dim=G, emb_dim=E, vocab=V)
    embed = nn.Embedding(V, H)
    with torch.no_grad():
        for p in head.parameters():  # large enough that the correction reorders candidates
            p.normal_(0, 0.5)
    return head.to(dtype), embed.to(dtype)


def make_round(bs: int, depth: int, seed: int) -> Round:
    g = torch.Generator().manual_seed(seed)
    return Round(
        ph=torch.randn(bs, depth, H, generator=g),
        logits=2 * torch.randn(bs, depth, V, generator=g),
        root=torch.randint(0, V - 1, (bs,), generator=g),
    )


def make_scorer(kind: str, rnd: Round, model, k: int, topm: int = 8, prefix_len: int = 1):
    if kind == "marginal":
        return MarginalScorer(rnd, k)
    if kind == "condstatic":
        return CondStaticScorer(rnd, *model, k, topm, prefix_len)
    return DominoScorer(rnd, *model, k, topm, prefix_len)


def ancestors_and_self(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_tree(t: Tree, past: int = 7):
    n = len(t)
    parents, depths, scores, tokens = t.parents.tolist(), t.depths.tolist(), t.scores.tolist(), t.tokens.tolist()
    assert parents[0] == -1 and depths[0] == 0 and scores[0] == 0.0
    for i in range(1, n):
        p = parents[i]
        assert 0 <= p < i, "parents precede children"
        assert depths[i] == depths[p] + 1
        assert scores[i] <= scores[p], "scores non-increasing along every path"
    siblings = {}
    for i in range(1, n):
        assert (parents[i], tokens[i]) not in siblings, "siblings carry distinct tokens"
        siblings[parents[i], tokens[i]] = i
    assert torch.equal(t.mask, ancestors_and_self(parents))
    assert torch.equal(t.positions(past), past + t.depths)
    packed = t.packed_mask()
    assert packed.dtype == torch.int32 and packed.shape == (n, (n + 31) // 32)
    words = (packed.to(torch.int64) & 0xFFFFFFFF).tolist()
    unpacked = [[bool(words[i][j // 32] >> (j % 32) & 1) for j in range(n)] for i in range(n)]
    assert torch.equal(torch.tensor(unpacked, dtype=torch.bool).reshape(n, n), t.mask)


def check_padding(ft, b: int, n_real: int):
    assert torch.equal(ft.tokens[b, n_real:], torch.full_like(ft.tokens[b, n_real:], MASK))
    assert (ft.parents[b, n_real:] == 0).all() and (ft.depths[b, n_real:] == 1).all()
    assert torch.isneginf(ft.scores[b, n_real:]).all()
    N = ft.tokens.shape[1]
    for i in range(n_real, N):
        row = torch.zeros(N, dtype=torch.bool)
        row[[0, i]] = True
        assert torch.equal(ft.mask[b, i], row)


def assert_same_tree(a: Tree, b: Tree):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.parents, b.parents)
    assert torch.equal(a.depths, b.depths)
    assert torch.allclose(a.scores, b.scores, atol=1e-5, rtol=0)
    assert torch.equal(a.mask, b.mask)


# (kind, topm, prefix_len, depth, k, budget, real nodes per tree)
CASES = [("domino", m, p, 5, 3, 12, 12) for m, p in DOMINO_CONFIGS] + [
    ("marginal", 8, 1, 5, 3, 12, 12),
    ("condstatic", 8, 1, 5, 3, 12, 12),
    ("condstatic", 0, 2, 5, 3, 12, 12),
    ("domino", 8, 1, 2, 2, 12, 6),  # exhausted: 2 + 4 reachable nodes, 6 padding slots
    ("marginal", 8, 1, 2, 2, 12, 6),
    ("domino", 8, 1, 5, 3, 2, 2),  # budget < k: fewer lanes than children per node
    ("domino", 0, 0, 4, 4, 40, 40),
]


@pytest.mark.parametrize("bs", [1, 2, 5])
@pytest.mark.parametrize("kind,topm,prefix_len,depth,k,budget,n_real", CASES)
def test_heap_and_frontier_select_the_same_tree(bs, kind, topm, prefix_len, depth, k, budget, n_real):
    model = make_model(seed=bs)
    rnd = make_round(bs, depth, seed=100 * bs + depth)
    ft = build_frontier(make_scorer(kind, rnd, model, k, topm, prefix_len), budget, depth, MASK)
    N = budget + 1
    assert ft.tokens.shape == ft.parents.shape == ft.depths.shape == ft.scores.shape == (bs, N)
    assert ft.mask.shape == (bs, N, N) and ft.scores.dtype == torch.float32
    assert torch.equal(ft.tokens[:, 0], rnd.root)
    for b in range(bs):
        heap = build_heap(make_scorer(kind, rnd.select(b), model, k, topm, prefix_len), budget, depth)
        assert len(heap) == n_real + 1
        assert_same_tree(heap, ft.tree(b))
        check_padding(ft, b, n_real + 1)
        whole = ft.whole(b)  # what a drafting graph hands the verify: every slot, the real nodes first
        assert len(whole) == N and whole.tokens.data_ptr() != ft.tokens[b].data_ptr()
        assert_same_tree(heap, _first(whole, n_real + 1))


def _first(tree: Tree, n: int) -> Tree:
    return Tree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.scores[:n], tree.mask[:n, :n])


class LastChildScorer:
    """Path-dependent toy scorer: of the root's ten children only the worst one has a good child (and that child
    a good child), so the best 12 nodes are all ten depth-0 nodes plus that chain: the frontier needs 10 lanes."""

    k, depth = 10, 3

    def __init__(self, bs: int):
        self.batch = bs
        self.round = Round(torch.zeros(bs, 3, 1), torch.zeros(bs, 3, V), torch.arange(bs))

    def root_states(self):
        return torch.full((self.batch, 1), -1.0)

    def children(self, states, depth):
        j = torch.arange(self.k)
        if depth == 0:
            tokens, lp = j, -1 - 0.01 * j
        else:
            tokens, lp = 100 + j, -5 - 0.01 * j
        good = ((states == 9) | (states == 100)) & (depth > 0)  # [bs, n, 1]
        lp = torch.where(good & (j == 0), torch.tensor(-0.001), lp)
        shape = (self.batch, states.shape[1], self.k)
        return tokens.expand(shape), lp.expand(shape)

    def advance(self, states, tokens):
        return tokens[..., None].float()


@pytest.mark.parametrize("bs", [1, 3])
def test_frontier_keeps_every_lane_it_needs(bs):
    ft = build_frontier(LastChildScorer(bs), 12, 3, MASK)
    heap = build_heap(LastChildScorer(1), 12, 3)
    assert heap.depths.tolist() == [0] + [1] * 10 + [2, 3]
    assert heap.tokens[-2:].tolist() == [100, 100] and heap.parents[-2:].tolist() == [10, 11]
    for b in range(bs):
        t = ft.tree(b)
        assert t.tokens[0] == b
        assert_same_tree(heap, Tree(torch.cat((heap.tokens[:1], t.tokens[1:])), t.parents, t.depths, t.scores, t.mask))


def test_max_depth_below_block_depth():
    model, rnd = make_model(), make_round(2, 5, seed=3)
    ft = build_frontier(DominoScorer(rnd, *model, 3, 8, 1), 12, 3, MASK)
    assert ft.depths.max() == 3
    for b in range(2):
        assert_same_tree(build_heap(DominoScorer(rnd.select(b), *model, 3, 8, 1), 12, 3), ft.tree(b))


def test_heap_does_not_expand_the_last_pop():
    calls = []

    class Counting(MarginalScorer):
        def children(self, states, depth):
            calls.append(depth)
            return super().children(states, depth)

    rnd = make_round(1, 5, seed=1)
    build_heap(Counting(rnd, 3), 4, 5)
    assert len(calls) == 4  # the root and the first three pops; the fourth pop is never expanded


def eager_heap(scorer, budget: int, max_depth: int) -> Tree:
    """The heap as it was before states were computed on demand: every pushed child advanced at once."""
    import heapq
    import itertools

    depth_limit, heap, counter = min(max_depth, scorer.depth), [], itertools.count()

    def push(state, cum, depth, parent):
        tokens, logprobs = scorer.children(state, depth)
        cums = (logprobs[0, 0] + cum).tolist()
        states = None
        if depth + 1 < depth_limit:
            states = scorer.advance(state.expand(1, tokens.shape[-1], state.shape[-1]), tokens[:, 0])
        for j, tok in enumerate(tokens[0, 0].tolist()):
            child = None if states is None else states[:, j : j + 1]
            heapq.heappush(heap, (-cums[j], next(counter), tok, depth, parent, child))

    tokens, parents, scores = [int(scorer.round.root[0])], [-1], [0.0]
    push(scorer.root_states()[:, None], 0.0, 0, 0)
    while heap and len(tokens) <= budget:
        neg_cum, _, tok, depth, parent, state = heapq.heappop(heap)
        tokens.append(tok), parents.append(parent), scores.append(-neg_cum)
        if len(tokens) <= budget and depth + 1 < depth_limit:
            push(state, -neg_cum, depth + 1, len(tokens) - 1)
    return Tree.from_parents(tokens, parents, scores)


class CountingDomino(DominoScorer):
    """DominoScorer counting the states it computes: roots, and rows advanced."""

    def root_states(self):
        self.roots = getattr(self, "roots", 0) + 1
        return super().root_states()

    def advance(self, states, tokens):
        self.advanced = getattr(self, "advanced", 0) + tokens.numel()
        return super().advance(states, tokens)


@pytest.mark.parametrize("topm, prefix_len", DOMINO_CONFIGS)
@pytest.mark.parametrize("budget", [1, 2, 3, 8, 30])
def test_heap_states_on_demand_give_the_eager_tree(topm, prefix_len, budget):
    """States computed only for popped-and-expanded nodes: the same tree as advancing every pushed child, with at most
    one advanced row per expanded node (the eager heap advanced k)."""
    model = make_model(seed=3)
    for seed in range(4):
        rnd = make_round(1, 5, seed=seed)
        lazy = CountingDomino(rnd, *model, 4, topm, prefix_len)
        got = build_heap(lazy, budget, 5)
        assert_same_tree(got, eager_heap(DominoScorer(rnd, *model, 4, topm, prefix_len), budget, 5))
        expanded = sum(1 for i in range(1, len(got)) if i < budget and int(got.depths[i]) < 5)
        assert getattr(lazy, "advanced", 0) <= expanded


def test_a_budget_one_tree_over_the_prefix_computes_no_state():
    """prefix_len 1, budget 1: the one draft is the base marginal's best; no GRU step runs (on exported stages, no
    scorer stage runs: tests/test_export_scorer.py)."""
    model, rnd = make_model(), make_round(1, 5, seed=2)
    lazy = CountingDomino(rnd, *model, 4, 8, 1)
    tree = build_heap(lazy, 1, 5)
    assert getattr(lazy, "roots", 0) == 0 and getattr(lazy, "advanced", 0) == 0
    assert int(tree.tokens[1]) == int(rnd.base[0, 0].argmax())
    deeper = CountingDomino(rnd, *model, 4, 8, 1)
    build_heap(deeper, 2, 5)
    assert deeper.roots == 1 and deeper.advanced == 1  # the first pop only


class TiedScorer(LastChildScorer):
    """The root's children all at one log-prob: the heap pops the first of equals."""

    def children(self, states, depth):
        n = states.shape[1]
        return torch.tensor([[[7, 3, 9]]]).expand(1, n, 3), torch.full((1, n, 3), -1.5)


@pytest.mark.parametrize("topm, prefix_len", DOMINO_CONFIGS)
def test_a_budget_one_tree_is_the_first_pop_of_any_budget(topm, prefix_len):
    """build_heap's budget-1 path (no heap) gives the first node every larger budget pops first, its score
    included, whether depth 0 reads the root's state or not; a refusing stop leaves the root alone."""
    model = make_model(seed=5)
    for seed in range(4):
        rnd = make_round(1, 5, seed=seed)
        one = build_heap(DominoScorer(rnd, *model, 4, topm, prefix_len), 1, 5)
        more = build_heap(DominoScorer(rnd, *model, 4, topm, prefix_len), 6, 5)
        assert len(one) == 2
        for a, b in ((one.tokens, more.tokens), (one.parents, more.parents), (one.scores, more.scores)):
            assert torch.equal(a, b[:2])
    tied = TiedScorer(1)
    assert build_heap(tied, 1, 3).tokens.tolist() == build_heap(TiedScorer(1), 3, 3).tokens[:2].tolist()
    assert int(build_heap(tied, 1, 3).tokens[1]) == 7

    class Refuse:
        def start(self):
            pass

        def admit(self, n_nodes, logw):
            return False

    alone = build_heap(DominoScorer(make_round(1, 5, seed=1), *model, 4, 8, 1), 1, 5, Refuse())
    assert alone.tokens.tolist() == [int(make_round(1, 5, seed=1).root[0])] and alone.mask.tolist() == [[True]]


@pytest.mark.parametrize("n", [0, 1, 5, 11])
def test_heap_with_a_stop_is_a_prefix_of_the_full_heap(n):
    """cadominotree's stop: the tree is the first n pops of the fixed-budget heap, and the rule saw the scores of
    those pops (non-increasing) and of the one it refused."""
    model, rnd = make_model(), make_round(1, 5, seed=4)

    class StopAfter:
        def start(self):
            self.seen = []

        def admit(self, n_nodes, logw):
            self.seen.append((n_nodes, logw))
            return n_nodes < n

    full = build_heap(DominoScorer(rnd, *model, 3, 8, 1), 16, 5)
    stop = StopAfter()
    cut = build_heap(DominoScorer(rnd, *model, 3, 8, 1), 16, 5, stop)
    assert len(cut) == n + 1
    for a, b in ((cut.tokens, full.tokens), (cut.parents, full.parents), (cut.scores, full.scores)):
        assert torch.equal(a, b[: n + 1])
    assert [m for m, _ in stop.seen] == list(range(n + 1))
    assert [w for _, w in stop.seen] == full.scores[1 : n + 2].tolist()


def test_frontier_positions_and_packed_mask():
    ft = build_frontier(MarginalScorer(make_round(3, 4, seed=2), 2), 6, 4, MASK)
    past = torch.tensor([10, 20, 30])
    assert torch.equal(ft.positions(past), past[:, None] + ft.depths)
    assert torch.equal(ft.positions(5), 5 + ft.depths)
    assert torch.equal(ft.packed_mask()[1], ft.tree(1).packed_mask())


def naive_children(rnd: Round, head, embed, k, topm, prefix_len, b, state, d):
    """DominoTree's per-node scoring, written out from the head's own modules."""
    base = rnd.base[b, d]
    if d < prefix_len:
        lp, tok = torch.topk(torch.log_softmax(base, -1), k)
        return tok, lp
    h = head.bottleneck(rnd.ph[b, d], state).float()
    if topm:
        cand = torch.topk(base, topm).indices
        corrected = base[cand] + h @ head.w2[cand].float().T
        lp, local = torch.topk(torch.log_softmax(corrected, -1), min(k, topm))
        return cand[local], lp
    lp, tok = torch.topk(torch.log_softmax(base + head.delta(rnd.ph[b, d], state), -1), k)
    return tok, lp


@pytest.mark.parametrize("topm,prefix_len", DOMINO_CONFIGS)
@torch.no_grad()
def test_domino_scorer_matches_per_node_reference(topm, prefix_len):
    head, embed = model = make_model(seed=5)
    bs, D, n, k = 2, 5, 4, 3
    rnd = make_round(bs, D, seed=6)
    sc = DominoScorer(rnd, *model, k, topm, prefix_len)
    _, root = head.prefix_gru(embed(rnd.root)[:, None])
    assert torch.allclose(sc.root_states(), root[0], atol=1e-6)
    states = torch.randn(bs, n, G)
    for d in range(D):
        assert torch.allclose(
            sc.bottleneck(states, d), head.bottleneck(rnd.ph[:, d, None].expand(bs, n, H), states), atol=1e-5
        )
        tokens, logprobs = sc.children(states, d)
        assert tokens.shape == logprobs.shape == (bs, n, min(k, topm or V))
        assert logprobs.dtype == torch.float32
        for b in range(bs):
            for i in range(n):
                tok, lp = naive_children(rnd, head, embed, k, topm, prefix_len, b, states[b, i], d)
                assert torch.equal(tokens[b, i], tok)
                assert torch.allclose(logprobs[b, i], lp, atol=1e-5)
    tokens = torch.randint(0, V, (bs, n))
    _, child = head.prefix_gru(embed(tokens).reshape(bs * n, 1, H), states.reshape(1, bs * n, G))
    assert torch.allclose(sc.advance(states, tokens), child.reshape(bs, n, G), atol=1e-6)


@torch.no_grad()
def test_domino_children_depend_on_the_path():
    model, rnd = make_model(seed=7), make_round(1, 4, seed=7)
    sc = DominoScorer(rnd, *model, 8, 16, 1)
    a, b = sc.advance(sc.root_states()[:, None].expand(1, 2, G), torch.tensor([[3, 4]])).unbind(1)
    lp_a, lp_b = sc.children(a[:, None], 1)[1], sc.children(b[:, None], 1)[1]
    assert not torch.allclose(lp_a, lp_b, atol=1e-3)
    # and the marginal scorer does not
    m = MarginalScorer(rnd, 8)
    assert torch.equal(m.children(a[:, None], 1)[1], m.children(b[:, None], 1)[1])


@pytest.mark.parametrize("topm,prefix_len", DOMINO_CONFIGS)
def test_condstatic_with_one_child_is_the_domino_greedy_chain(topm, prefix_len):
    model, D = make_model(seed=8), 5
    for seed in range(3):
        rnd = make_round(1, D, seed=seed)
        chain = build_heap(DominoScorer(rnd, *model, 1, topm, prefix_len), D, D)
        cond = CondStaticScorer(rnd, *model, 1, topm, prefix_len)
        static = build_heap(cond, D, D)
        assert static.parents.tolist() == list(range(-1, D))
        assert_same_tree(chain, static)
        assert cond.greedy[0].tolist() == chain.tokens[1:].tolist()


def test_condstatic_shares_one_table_per_depth():
    model, rnd = make_model(seed=9), make_round(1, 4, seed=9)
    t = build_heap(CondStaticScorer(rnd, *model, 3, 8, 1), 30, 4)
    kids: dict[int, list[set]] = {}
    for i in range(len(t)):
        child_tokens = {t.tokens[j].item() for j in range(len(t)) if t.parents[j] == i}
        if len(child_tokens) == 3:
            kids.setdefault(t.depths[i].item(), []).append(child_tokens)
    assert any(len(sets) > 1 for sets in kids.values())
    for sets in kids.values():
        assert all(s == sets[0] for s in sets)


def test_bf16_head_scores_in_fp32():
    model, rnd = make_model(seed=10, dtype=torch.bfloat16), make_round(2, 5, seed=10)
    ft = build_frontier(DominoScorer(rnd, *model, 3, 8, 1), 12, 5, MASK)
    assert ft.scores.dtype == torch.float32
    heap = build_heap(DominoScorer(rnd.select(0), *model, 3, 8, 1), 12, 5)
    assert heap.scores.dtype == torch.float32
    for t in (heap, ft.tree(0), ft.tree(1)):
        check_tree(t)
        assert len(t) == 13
    head = model[0]
    sc, states = DominoScorer(rnd, *model, 3, 8, 1), torch.randn(2, 4, G, dtype=torch.bfloat16)
    reference = copy.deepcopy(head).float().bottleneck(rnd.ph[:, 2, None].expand(2, 4, H), states.float())
    assert torch.allclose(sc.bottleneck(states, 2), reference, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    "kind,topm,prefix_len", [("domino", 8, 1), ("domino", 0, 0), ("marginal", 8, 1), ("condstatic", 8, 1)]
)
@pytest.mark.parametrize("bs", [1, 5])
def test_frontier_has_no_host_sync(monkeypatch, kind, topm, prefix_len, bs):
    model, rnd = make_model(seed=11), make_round(bs, 5, seed=11)
    scorer = make_scorer(kind, rnd, model, 3, topm, prefix_len)
    expected = build_frontier(scorer, 12, 5, MASK)
    with monkeypatch.context() as mp:
        no_host_sync(mp)
        got = build_frontier(make_scorer(kind, rnd, model, 3, topm, prefix_len), 12, 5, MASK)
    for name in ("tokens", "parents", "depths", "scores", "mask"):
        assert torch.equal(getattr(got, name), getattr(expected, name))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    bs=st.integers(1, 3),
    depth=st.integers(1, 5),
    k=st.integers(1, 4),
    budget=st.integers(1, 20),
    topm=st.sampled_from([0, 3, 8]),
    prefix_len=st.integers(0, 3),
    kind=st.sampled_from(["domino", "marginal", "condstatic"]),
)
def test_builder_invariants(seed, bs, depth, k, budget, topm, prefix_len, kind):
    model, rnd = make_model(seed=seed % 7), make_round(bs, depth, seed=seed)
    heap = build_heap(make_scorer(kind, rnd.select(0), model, k, topm, prefix_len), budget, depth)
    check_tree(heap)
    assert heap.scores[1:].tolist() == sorted(heap.scores[1:].tolist(), reverse=True), "pop order"
    assert 1 <= len(heap) <= budget + 1
    ft = build_frontier(make_scorer(kind, rnd, model, k, topm, prefix_len), budget, depth, MASK)
    for b in range(bs):
        t = ft.tree(b)
        check_tree(t)
        assert t.scores[1:].tolist() == sorted(t.scores[1:].tolist(), reverse=True)
        check_padding(ft, b, len(t))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), depth=st.integers(1, 6), vocab=st.integers(1, 12), budget=st.integers(1, 40))
def test_ddtree_invariants(seed, depth, vocab, budget):
    g = torch.Generator().manual_seed(seed)
    t = build_ddtree(torch.log_softmax(3 * torch.randn(depth, vocab, generator=g), -1), budget, root=4)
    check_tree(t)
    assert t.tokens[0] == 4 and len(t) == 1 + min(budget, sum(vocab**d for d in range(1, depth + 1)))
    assert t.scores[1:].tolist() == sorted(t.scores[1:].tolist(), reverse=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("topm,prefix_len", [(8, 1), (0, 0)])
def test_frontier_has_no_cuda_sync(topm, prefix_len):
    model, rnd = make_model(seed=12), make_round(5, 5, seed=12)
    expected = build_frontier(DominoScorer(rnd, *model, 3, topm, prefix_len), 12, 5, MASK)
    model = [m.cuda() for m in model]
    rnd = Round(rnd.ph.cuda(), rnd.base.cuda(), rnd.root.cuda())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = build_frontier(DominoScorer(rnd, *model, 3, topm, prefix_len), 12, 5, MASK)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(got, name).cpu(), getattr(expected, name))
    assert torch.allclose(got.scores.cpu(), expected.scores, atol=1e-4)

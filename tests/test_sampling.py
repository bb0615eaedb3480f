"""At T>0 the committed tokens follow the target's own distribution, for every method (chi-square test against
the exact distribution of the first three tokens), and the test rejects a wrong distribution."""

import itertools

import pytest
import torch
from helpers import pipe_for, spec

from dtrt.runtime.sampling import Draws, SamplingConfig, draw, draw_rows, target_probs, uniforms
from dtrt.tree.tree import Tree

PROMPTS = [
    "The cat sees ",
    "The moon is very ",
    "Every king ",
    "A small ",
    "Some old man reads ",
    "A quick fox ",
    "The dog ",
    "One happy child ",
]
T, TOP_P, N, PILOT = 1.0, 0.9, 300, 12


def exact_triples(target, prompt, temperature):
    """P(t1, t2, t3) under the target with temperature and top-p, by enumeration: each level's continuations are
    verified as siblings of one tree call, as a tree verify does (a high temperature's nucleus holds most of the
    vocabulary, too many triples for a call each)."""

    def probs(prefix, children):
        """Next-token probabilities after `prefix` (row 0) and after `prefix + [c]` for each child c (rows 1...)."""
        n = len(prefix)
        tree = Tree.from_parents(prefix + children, list(range(-1, n - 1)) + [n - 1] * len(children))
        logits, _ = target(tree.tokens, tree.positions(0), tree.mask)
        return target_probs(logits[n - 1 :], temperature, TOP_P)

    def support(p):
        return p.nonzero().flatten().tolist()

    dist = {}
    with torch.no_grad():
        p1 = probs(prompt, [])[0]
        firsts = support(p1)
        for a, p2 in zip(firsts, probs(prompt, firsts)[1:]):
            seconds = support(p2)
            for b, p3 in zip(seconds, probs(prompt + [a], seconds)[1:]):
                for c in support(p3):
                    dist[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return dist


def chi_square_pvalue(counts: dict, dist: dict, n: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in dist.items():
        e, o = n * p, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, dof = stat + (o - e) ** 2 / e, dof + 1
    outside = sum(o for c, o in counts.items() if c not in dist)
    if pooled_exp > 0:
        stat, dof = stat + (pooled_obs + outside - pooled_exp) ** 2 / pooled_exp, dof + 1
    elif outside:
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def exact(tiny):
    """prompt -> (ids, exact distribution at T, the same at the wrong temperature 2.0), for prompts whose first
    three tokens are uncertain enough to test (at least 4 possible triples)."""
    pipe = pipe_for(tiny, spec("ar"))
    out = {}
    for prompt in PROMPTS:
        ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)
        dist = exact_triples(pipe.backend.target, ids, T)
        if len(dist) >= 4:
            out[prompt] = ids, dist, exact_triples(pipe.backend.target, ids, 2.0)
    assert len(out) >= 2, "the tiny target is too certain for a distribution test"
    return out


def sample(pipe, ids, n=N, first_seed=0):
    counts, accepted = {}, 0
    for seed in range(first_seed, first_seed + n):
        g = pipe.generate(ids, 3, SamplingConfig(T, TOP_P, seed))
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
        accepted += sum(r.accepted - 1 for r in g.rounds)
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "dflash", "domino", "ddtree", "caddtree", "dominotree", "dominotree-static"])
def test_tokens_follow_target_distribution(tiny, exact, method):
    """dominotree-static: --static-shapes, where a round draws every node on the device (a fixed-width verify)."""
    if method.endswith("-static"):
        method = method.removesuffix("-static")
        pipe = pipe_for(tiny, spec(method, static_shapes=True))
        pipe.backend.max_context = 256  # the static cache's context limit (the tiny target's 4,096 is slower)
    else:
        pipe = pipe_for(tiny, spec(method))
    # the prompt where this method's drafts are accepted most often (a short pilot run, other seeds)
    pilot = {p: sample(pipe, exact[p][0], PILOT, 10_000)[1] for p in exact} if method != "ar" else {}
    prompt = max(pilot, key=pilot.get) if pilot else next(iter(exact))
    ids, dist, wrong = exact[prompt]
    counts, accepted = sample(pipe, ids)
    if method != "ar":
        assert accepted >= N // 10, (prompt, accepted)  # committed tokens came from tree nodes below the root
    assert chi_square_pvalue(counts, dist, N) > 1e-3
    assert chi_square_pvalue(counts, wrong, N) < 1e-3  # the test has power: a different temperature is rejected


def test_seed_reproducible(tiny):
    pipe = pipe_for(tiny, spec("dominotree"))
    ids = pipe.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    a, b = (pipe.generate(ids, 30, SamplingConfig(1.0, 0.95, 7)).tokens for _ in range(2))
    assert a == b and a != pipe.generate(ids, 30, SamplingConfig(1.0, 0.95, 8)).tokens


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, 1.0, 0.8)
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert list(itertools.chain(target_probs(logits, 1.0, 1.0)[0].tolist())) == pytest.approx([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("method", ["dflash", "domino", "ddtree", "dominotree"])
def test_same_seed_commits_ar_tokens(tiny, method):
    """The token at each position is drawn with that position's uniform, under every method: with the same seed a
    method commits AR's very tokens at T>0, drafts accepted."""
    ar, pipe = pipe_for(tiny, spec("ar")), pipe_for(tiny, spec(method))
    accepted = 0
    for prompt in PROMPTS[:4]:
        ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)
        for seed in range(3):
            cfg = SamplingConfig(T, TOP_P, seed)
            g = pipe.generate(ids, 24, cfg)
            assert g.tokens == ar.generate(ids, 24, cfg).tokens, (prompt, seed)
            accepted += sum(r.accepted - 1 for r in g.rounds)
    assert accepted >= 12, accepted


def test_draw_follows_the_nucleus():
    """draw() samples target_probs: the nucleus only, in proportion (4,000 draws, a bound of 4 standard errors)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    u = uniforms(0, 4000).tolist()
    for top_p, want in ((0.8, [0.625, 0.375, 0.0, 0.0]), (1.0, [0.5, 0.3, 0.15, 0.05])):
        counts = torch.bincount(torch.tensor([draw(logits, 1.0, top_p, x) for x in u]), minlength=4)
        for c, p in zip((counts / 4000).tolist(), want):
            assert abs(c - p) <= 4 * (p * (1 - p) / 4000) ** 0.5 + 1e-9


def _rows_and_host(logits, temperature, top_p, u):
    rows = draw_rows(logits, torch.tensor(temperature), torch.tensor(top_p), u, nucleus=top_p < 1.0)
    return rows.tolist(), [draw(logits[i], temperature, top_p, float(u[i])) for i in range(len(u))]


@pytest.mark.parametrize("vocab", [40, 300, 5000])
def test_draw_rows_is_draw_at_every_row(vocab):
    """The device's draw at every row (a round's T>0 choice under --static-shapes) picks draw()'s token, row for
    row: plain logits, logits rounded to integers (many equal probabilities: both order them by token id), half the
    vocabulary at zero mass, temperatures and nuclei, and a uniform next to 1."""
    g = torch.Generator().manual_seed(vocab)
    picked = set()
    for trial in range(12):
        logits = torch.randn(8, vocab, generator=g) * 3
        if trial % 3 == 1:
            logits = logits.round()
        if trial % 4 == 2:
            logits[:, : vocab // 2] = -1e4
        for temperature in (0.5, 1.0, 1.7):
            for top_p in (1.0, 0.9, 0.5, 0.05):
                u = torch.rand(8, dtype=torch.float64, generator=g)
                u[0] = 1 - 2**-53
                rows, host = _rows_and_host(logits, temperature, top_p, u)
                assert rows == host, (trial, temperature, top_p)
                picked.update(rows)
    assert len(picked) > 20  # the draws spread over the vocabulary


def test_a_tie_across_the_first_64_is_settled_by_token_id():
    """Where the 64th most likely token ties with tokens past it and the tie reaches the nucleus, which of them are
    in depends on the order of equals: draw() looks past the top 64 and orders them by token id, as the device's
    sort does. Every uniform on a fine grid picks the same token both ways, the tied tokens included."""
    probs = torch.cat((torch.full((60,), 0.01), torch.full((200,), 0.002), torch.full((740,), 0.0001)))
    logits = torch.log(probs)[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    u = torch.linspace(0, 1 - 1e-9, 2001, dtype=torch.float64)
    rows, host = _rows_and_host(logits.expand(len(u), -1).contiguous(), 1.0, 0.7, u)
    assert rows == host
    tied = set(torch.nonzero(torch.isclose(torch.softmax(logits, -1), torch.tensor(0.002 / 1.074))).flatten().tolist())
    assert len(set(rows) & tied) > 4  # the tie is in the nucleus, past the top 64


def test_uniforms_are_keyed_by_position():
    """u[p] of a seed is the same whatever length the table has (a Draws grown on demand keeps its values), and
    seeds differ."""
    short, long = uniforms(5, 10), uniforms(5, 10_000)
    assert (short == long[:10]).all() and not (short == uniforms(6, 10)).all()
    draws = Draws(SamplingConfig(1.0, 1.0, 5), 4)
    assert draws.at(9_999) == long[9_999] and (draws.table(4)[:10] == short).all()
    assert ((0 <= long) & (long < 1)).all()

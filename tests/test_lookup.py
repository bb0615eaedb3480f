"""`--method lookup` on the tiny pair: the AR tokens at T=0 on torch and ONNX Runtime with lookup drafts accepted,
where the prompt holds the continuation (chains right), partly (right, then wrong) and not (wrong or none); AR's
very tokens at T>0 with the same seed, and the target's distribution over the first three tokens; dominotree with
--lookup: the AR tokens with lookup nodes accepted (torch, ONNX Runtime), AR's tokens at T>0 with the same seed,
and on ONNX Runtime the target's distribution with lookup nodes accepted."""

import pytest
from helpers import PROMPTS, pipe_for, spec
from test_sampling import TOP_P, N, T, chi_square_pvalue, exact_triples, sample

from dtrt.runtime.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET, NEW = 8, 48


@pytest.fixture(scope="module")
def cases(tiny):
    """(prompt ids, AR tokens): the first prompts as they are, then each followed by its own AR text and itself
    again, so that the text to come is in the prompt."""
    ar = pipe_for(tiny, spec("ar"))
    out = []
    for p in PROMPTS[:3]:
        ids = ar.tokenizer.encode(p, add_special_tokens=False)
        text = ar.tokenizer.decode(ar.generate(ids, NEW, SamplingConfig()).tokens)
        for prompt in (p, p + text + p):
            ids = ar.tokenizer.encode(prompt, add_special_tokens=False)
            out.append((ids, ar.generate(ids, NEW, SamplingConfig()).tokens))
    return out


def check_lookup(pipe, cases):
    rounds = []
    for ids, want in cases:
        g = pipe.generate(ids, NEW, SamplingConfig())
        assert g.tokens == want
        rounds += g.rounds
    kinds = {
        "none" if r.tree_size == 1 else "wrong" if r.accepted == 1 else "full" if r.accepted == BUDGET + 1 else "part"
        for r in rounds
    }
    assert kinds == {"none", "wrong", "part", "full"}, kinds
    assert sum(r.accepted - 1 for r in rounds) >= NEW, "lookup tokens accepted"
    assert all(r.lookup == r.accepted - 1 for r in rounds), "every accepted draft counted as lookup's"
    assert all(r.tree_size <= BUDGET + 1 for r in rounds)


def test_lookup_gives_the_ar_tokens_with_drafts_accepted(tiny, cases):
    pipe = pipe_for(tiny, spec("lookup", budget=BUDGET))
    assert pipe.backend.drafter is None  # a target alone
    check_lookup(pipe, cases)


def test_lookup_on_onnxruntime(tiny_export, cases):
    pipe = pipe_for(None, spec("lookup", budget=BUDGET), backend="onnxruntime", export=tiny_export.path, threads=1)
    check_lookup(pipe, cases)


def test_same_seed_commits_ar_tokens(tiny, cases):
    """A lookup token is accepted when the target's own draw is that token (probability p(token)); else the draw is
    the bonus token: p with the token removed, renormalised. With the same seed, AR's very tokens."""
    ar, pipe = pipe_for(tiny, spec("ar")), pipe_for(tiny, spec("lookup", budget=BUDGET))
    accepted = 0
    for ids, _ in cases:
        for seed in range(2):
            cfg = SamplingConfig(1.0, 0.9, seed)
            g = pipe.generate(ids, 24, cfg)
            assert g.tokens == ar.generate(ids, 24, cfg).tokens, seed
            accepted += sum(r.accepted - 1 for r in g.rounds)
    assert accepted >= 12, accepted


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The moon is very blue blue ", "man still sad city wind, man still sad "])
def test_tokens_follow_target_distribution(tiny, prompt):
    """Prompts whose lookup chain (blue ..., city ...) the target takes with probability 0.57 and 0.70: drawn 300
    times, the first three tokens follow the target's exact distribution (chi-square, tests/test_sampling.py), and
    the test tells a wrong temperature apart."""
    pipe = pipe_for(tiny, spec("lookup", budget=4))
    ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)
    dist, wrong = (exact_triples(pipe.backend.target, ids, t) for t in (T, 2.0))
    counts, accepted = sample(pipe, ids)
    assert accepted >= N // 2, accepted
    assert chi_square_pvalue(counts, dist, N) > 1e-3
    assert chi_square_pvalue(counts, wrong, N) < 1e-3


def check_mixed(pipe, cases):
    """--lookup: the AR tokens, lookup nodes among those accepted, within the budget."""
    taken = 0
    for ids, want in cases:
        g = pipe.generate(ids, NEW, SamplingConfig())
        assert g.tokens == want
        assert all(r.tree_size <= BUDGET + 1 for r in g.rounds)
        taken += sum(r.lookup for r in g.rounds)
    assert taken > 0, "lookup nodes accepted"
    source = pipe.method.lookup
    assert sum(source.verified.values()) > sum(source.accepted.values()), "some lookup nodes rejected"


def test_dominotree_with_lookup_gives_the_ar_tokens(tiny, cases):
    check_mixed(pipe_for(tiny, spec("dominotree", budget=BUDGET, lookup=True)), cases)


def test_dominotree_with_lookup_on_onnxruntime(tiny_export, cases):
    run = spec("dominotree", budget=BUDGET, lookup=True)
    check_mixed(pipe_for(None, run, backend="onnxruntime", export=tiny_export.path, threads=1), cases)


def test_dominotree_with_lookup_same_seed_commits_ar_tokens(tiny, cases):
    ar, pipe = pipe_for(tiny, spec("ar")), pipe_for(tiny, spec("dominotree", budget=BUDGET, lookup=True))
    for ids, _ in cases[1::2]:
        cfg = SamplingConfig(1.0, 0.9, 0)
        assert pipe.generate(ids, 24, cfg).tokens == ar.generate(ids, 24, cfg).tokens


@pytest.mark.slow
def test_dominotree_with_lookup_follows_the_target_distribution_on_onnxruntime(tiny, tiny_export):
    """T > 0 on ONNX Runtime: DominoTree's tree with lookup's chain in it (the prompt's `blue ...`, which the target
    takes with probability 0.57), drawn 300 times: the first three tokens follow the target's exact distribution
    (chi-square), lookup nodes are accepted, and a wrong temperature is told apart."""
    run = spec("dominotree", budget=4, lookup=True)
    pipe = pipe_for(None, run, backend="onnxruntime", export=tiny_export.path, threads=1)
    ids = pipe.tokenizer.encode("The moon is very blue blue ", add_special_tokens=False)
    dist, wrong = (exact_triples(pipe_for(tiny, spec("ar")).backend.target, ids, t) for t in (T, 2.0))
    counts, lookup = {}, 0
    for seed in range(N):
        g = pipe.generate(ids, 3, SamplingConfig(T, TOP_P, seed))
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
        lookup += sum(r.lookup for r in g.rounds)
    assert lookup >= N // 4, lookup
    assert chi_square_pvalue(counts, dist, N) > 1e-3
    assert chi_square_pvalue(counts, wrong, N) < 1e-3


def test_lookup_is_on_by_default_where_the_registry_measured_it():
    """The embedded default's targets with DominoTree on a CPU take lookup's chains unless --no-lookup (the fp32 one
    at budget 4, the gguf, int8 and int4 ones at 2); the other methods, the frontier and the other
    models do not."""
    from dtrt.launch import resolve_spec

    assert resolve_spec().lookup and resolve_spec(method="cadominotree").lookup
    assert resolve_spec().label.startswith("dominotree+lookup@2") and resolve_spec(quant="gguf-a8").budget == 2
    assert resolve_spec(quant="none").label.startswith("dominotree+lookup@4")
    assert not resolve_spec(lookup=False).lookup
    assert resolve_spec(quant="int8").label == resolve_spec(quant="int4").label == "dominotree+lookup@2"
    assert resolve_spec(quant="int4", lookup=False).label == "dominotree@1"
    assert not resolve_spec(quant="int4", lookup=False).lookup and not resolve_spec(method="ddtree").lookup
    assert not resolve_spec(builder="frontier").lookup and not resolve_spec(model="tiny").lookup
    assert resolve_spec(model="tiny", lookup=True).lookup

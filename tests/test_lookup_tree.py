"""`--lookup`: DominoTree's heap builder takes lookup chains' nodes as well as the drafter's, in one tree of one
budget. On the fake backend: the AR tokens with lookup nodes accepted, the same tree as without --lookup where
nothing matches, the trie's merging and scoring, and the flags that refuse it."""

import math

import pytest
import torch
from fake_backend import D, FakeBackend, fake_pipeline, successor

from dtrt.errors import DtrtError
from dtrt.launch import resolve_spec
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec
from dtrt.tree import MarginalScorer, Round, build_heap
from dtrt.tree.lookup_scorer import LookupScorer, Trie
from dtrt.tree.lookup_source import LookupSource

BUDGET, NEW = 8, 40


def chain_from(t: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(t)
        t = successor(t)
    return out


def repeating() -> list[int]:
    return chain_from(1, 12) * 2


def partly_wrong() -> list[int]:
    """Right for three tokens after the match, then a token the target never gives there."""
    c = chain_from(1, 8)
    return c[:5] + [(successor(c[4]) + 7) % 32] + c[:2]


def trees_of(pipe):
    built = []
    build = pipe.method.build

    def record(backend, rnd):
        tree = build(backend, rnd)
        built.append(tree)
        return tree

    pipe.method.build = record
    return built


@pytest.mark.parametrize("method", ["dominotree", "cadominotree"])
def test_ar_tokens_with_lookup_nodes_accepted(method):
    ar = fake_pipeline("ar")
    pipe = fake_pipeline(method, lookup=True, budget=BUDGET)
    if method == "cadominotree":
        from test_methods import LINEAR_COST

        pipe.method.curve = LINEAR_COST
    taken = 0
    for prompt in (repeating(), partly_wrong(), [0, 2, 4]):
        g = pipe.generate(prompt, NEW, SamplingConfig())
        assert g.tokens == ar.generate(prompt, NEW, SamplingConfig()).tokens
        assert all(r.tree_size <= BUDGET + 1 for r in g.rounds)
        assert g.stats()["from_lookup"] == [r.lookup for r in g.rounds]
        taken += sum(r.lookup for r in g.rounds)
    assert taken > 0


def drafted_starts(pipe) -> list[int]:
    starts, draft_block = [], pipe.backend.draft_block
    pipe.backend.draft_block = lambda root, start, **kw: starts.append(start) or draft_block(root, start, **kw)
    return starts


def test_a_chain_worth_a_drafted_round_is_verified_alone():
    """Where lookup's chain is expected to be accepted for at least what drafted rounds have been accepting (the
    running gain), the round verifies the chain alone and the drafter is not called; AR's tokens all the same.
    With drafted rounds worth more than any chain, every round drafts (the chain's nodes join the drafter's
    tree); the gain is measured on the drafted rounds."""
    want = fake_pipeline("ar").generate(repeating(), NEW, SamplingConfig()).tokens
    cheap = fake_pipeline("dominotree", lookup=True, budget=BUDGET)
    cheap.method.policy.gain = -1.0  # a drafted round gives nothing: any chain beats it, however long it takes
    starts = drafted_starts(cheap)
    g = cheap.generate(repeating(), NEW, SamplingConfig())
    assert g.tokens == want
    at = len(repeating()) + torch.tensor([0] + [r.accepted for r in g.rounds[:-1]]).cumsum(0)
    alone = [r for r, start in zip(g.rounds, at.tolist()) if start not in starts]
    assert len(starts) < len(g.rounds) and alone and all(1 < r.tree_size <= D + 1 for r in alone)
    assert sum(r.lookup for r in alone) == sum(r.accepted - 1 for r in alone) > 0  # the chain's tokens, accepted

    dear = fake_pipeline("dominotree", lookup=True, budget=BUDGET)
    dear.method.policy.gain = math.inf
    starts = drafted_starts(dear)
    g = dear.generate(repeating(), NEW, SamplingConfig())
    assert g.tokens == want and len(starts) == len(g.rounds) and sum(r.lookup for r in g.rounds) > 0

    measured = fake_pipeline("dominotree", lookup=True, budget=BUDGET)
    assert (
        measured.generate(partly_wrong(), NEW, SamplingConfig()).tokens
        == fake_pipeline("ar").generate(partly_wrong(), NEW, SamplingConfig()).tokens
    )
    assert measured.method.policy.gain > 1.0  # the fake drafter's trees accept more than the prior


def test_a_chain_just_accepted_whole_is_proposed_as_deep_as_a_tree_goes():
    """Budget 2 under a drafter of depth D: chains are 2 tokens long until one is accepted whole, then D long while
    they keep being accepted whole, and 2 again after one is not; AR's tokens throughout."""
    want = fake_pipeline("ar").generate(repeating(), NEW, SamplingConfig()).tokens
    pipe = fake_pipeline("dominotree", lookup=True, budget=2)
    pipe.method.policy.gain = -1.0  # every round with a chain verifies it alone: its length is the tree's
    g = pipe.generate(repeating(), NEW, SamplingConfig())
    assert g.tokens == want
    sizes = [r.tree_size - 1 for r in g.rounds]
    accepted = [r.accepted - 1 for r in g.rounds]
    assert max(sizes) == D and sizes[0] <= 2
    for i in range(1, len(g.rounds)):
        whole = sizes[i - 1] > 0 and accepted[i - 1] == sizes[i - 1]
        assert sizes[i] <= (D if whole else 2), (i, sizes, accepted)
    assert sum(accepted) > len(g.rounds)  # more than a token a round from the chains


def test_chain_or_draft_weighs_tokens_by_the_seconds_they_take():
    """A chain expected to give 0.6 tokens against drafted rounds that give 1: drafted while both kinds take as
    long, alone once drafted rounds take 1.8x a chain round (1.6 tokens a chain round, 2 in 1.8 of them); the time
    between generations counts for no kind."""
    from dtrt.tree.lookup_source import ChainOrDraft

    p = ChainOrDraft(gain=1.0)
    assert p.choose(0.6, now=0.0) == "draft" and p.choose(0.0, now=1.0) == "bare"  # one timed kind only
    assert p.seconds == {"draft": 1.0}
    assert p.choose(1.0, now=2.0) == "chain"  # 1 + 1 >= 1 + 1 at equal (assumed) times
    assert p.choose(0.6, now=3.0) == "draft"  # the chain round took 1 s: still equal times
    p.restart()
    p.seconds = {"chain": 1.0, "draft": 1.8, "bare": 1.8, "root": 1.0}
    assert p.choose(0.6, now=100.0) == "chain" and p.choose(0.0, now=101.0) == "bare"  # the root rule is off
    assert p.seconds["chain"] == pytest.approx(1.0)
    p.observe_drafted(3)  # a round without a chain: both gains
    assert p.gain == pytest.approx(1.2) and p.bare_gain == pytest.approx(1.2)


def test_the_root_goes_alone_where_drafting_does_not_pay():
    """With no chain: a drafted round first (nothing to weigh), then the root alone once, to time it; then the root
    alone while drafted rounds without a chain give no more tokens a second than root-alone rounds (1.3 tokens in
    1.4 s against 1 in 1 s), a drafted round again after EXPLORE root-alone rounds, then after twice as many while
    those rounds do not turn the choice, and drafting where it pays (2.5 tokens in 1.4 s), which starts the count
    again from EXPLORE."""
    from dtrt.tree.lookup_source import ChainOrDraft

    p = ChainOrDraft(gain=1.0)
    p.root_alone = True  # off for the other tests (conftest)
    assert p.choose(0.0, now=0.0) == "bare"  # drafts: nothing timed yet
    p.observe_drafted(0)
    assert p.choose(0.0, now=1.4) == "root"  # once, to be timed
    assert p.seconds == {"draft": 1.4, "bare": 1.4}
    p.seconds, p.bare_gain = {"draft": 1.4, "bare": 1.4, "root": 1.0}, 0.3
    t = 2.4
    kinds = []
    e = ChainOrDraft.EXPLORE  # the timing round was the first root-alone round since the last drafted one
    for _ in range(e + 2 * e + 2):
        kinds.append(p.choose(0.0, now=t))
        p.seconds = {"draft": 1.4, "bare": 1.4, "root": 1.0}  # keep the figures fixed
        t += 1.0
    assert kinds == ["root"] * (e - 1) + ["bare"] + ["root"] * (2 * e) + ["bare"] + ["root"], kinds
    assert p.explore == 4 * e
    p.bare_gain = 1.5
    assert p.choose(0.0, now=t) == "bare" and p.explore == e  # 2.5 tokens in 1.4 s beat 1 in 1 s
    p.bare_gain, p.root_alone = 0.3, False
    assert p.choose(0.0, now=t + 1) == "bare"  # the rule off: a round with no chain drafts


def test_the_root_goes_alone_past_a_chain_that_does_not_pay():
    """A chain of 2 expected to give 0.3 tokens, chain-alone rounds of 2 taking 1.5 s, drafted rounds giving 1.2 in
    2 s, root-alone rounds 1 in 1 s: the root alone (the chain would be chosen over drafting, and gives 0.87 tokens
    a second), and the chain again after EXPLORE such rounds in a row; a chain expected to give 0.6 (1.07 tokens a
    second) goes alone, unless it is 5 long and chains of 5 have taken 3 s. Nothing goes alone before the chain and
    the drafted rounds are timed."""
    from dtrt.tree.lookup_source import ChainOrDraft

    p = ChainOrDraft(gain=0.2)
    p.root_alone = True  # off for the other tests (conftest)

    def timed(seconds=None):  # the figures kept fixed, as measured before
        p.seconds = seconds or {"chain": 2.0, "draft": 2.0, "bare": 2.0, "root": 1.0}
        p.chain_seconds = {2: 1.5, 5: 3.0}

    kinds, t = [], 0.0
    for _ in range(2 * (ChainOrDraft.EXPLORE + 1)):
        timed()
        kinds.append(p.choose(0.3, now=t, length=2))
        t += 1.0
    e = ChainOrDraft.EXPLORE
    assert kinds == (["root"] * e + ["chain"]) * 2, kinds
    timed()
    assert p.choose(0.6, now=t, length=2) == "chain"
    timed()
    assert p.choose(0.6, now=t + 1, length=5) == "root"
    timed()
    assert p.choose(0.6, now=t + 2, length=3) == "root"  # no chain of 3 timed: all chains' 2 s
    p.gain = 1.0  # drafted rounds' 2 tokens in 2 s: the chain loses to them, they tie the root
    timed()
    assert p.choose(0.3, now=t + 3, length=2) == "root"
    p.gain = 0.2
    timed({"draft": 2.0, "bare": 2.0, "root": 1.0})  # no chain-alone round timed yet
    assert p.choose(0.3, now=t + 4, length=2) == "chain"
    p.root_alone = False
    timed()
    assert p.choose(0.3, now=t + 5, length=2) == "chain"  # the rule off
    # the chain round of 2 at t + 4 took 1 s: into the figures of chains of 2 and of all chains
    assert p.chain_seconds == pytest.approx({2: 1.45, 5: 3.0}) and p.seconds["chain"] == pytest.approx(1.9)


def test_greedy_and_sampled_generations_keep_their_own_figures():
    from dtrt.runtime.methods import make_method

    method = make_method(RunSpec(method="dominotree", lookup=True))
    method.begin([1, 2, 3])
    greedy = method.policy
    method.begin([1, 2, 3], sampled=True)
    assert method.policy is method.policies[True] is not greedy
    method.begin([1, 2, 3])
    assert method.policy is greedy


def test_lookup_partly_wrong_is_measured():
    pipe = fake_pipeline("dominotree", lookup=True, budget=16)
    g = pipe.generate(partly_wrong(), 6, SamplingConfig())
    assert g.tokens == fake_pipeline("ar").generate(partly_wrong(), 6, SamplingConfig()).tokens
    source = pipe.method.lookup
    assert sum(source.verified.values()) > sum(source.accepted.values()) > 0, (source.verified, source.accepted)


def test_no_match_builds_the_tree_without_lookup():
    prompt = [0, 2, 4, 6]  # the first root, successor(6) = 13, has not occurred: no chain
    plain, mixed = fake_pipeline("dominotree", budget=BUDGET), fake_pipeline("dominotree", lookup=True, budget=BUDGET)
    a, b = trees_of(plain), trees_of(mixed)
    plain.generate(prompt, 2, SamplingConfig())
    mixed.generate(prompt, 2, SamplingConfig())
    assert len(a) == len(b) >= 1
    for x, y in zip(a, b):
        for f in ("tokens", "parents", "depths", "scores", "mask"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f


def fake_round(root: int, start: int):
    _, base = FakeBackend().draft_block(root, start, rows=D)
    return Round(torch.zeros(1, D, 1), base[None], torch.tensor([root]))


def test_lookup_children_merge_and_score():
    rnd = fake_round(1, 2)  # mode 1: depth 2's drafter argmax is wrong, the right token second
    inner = MarginalScorer(rnd, 2)
    plain = build_heap(MarginalScorer(rnd, 2), 6, D)
    right = chain_from(successor(1), D)
    other = [right[0], right[1], 30, 31]  # shares two tokens with the drafter's children, then off them
    trie = Trie.of([right, other])
    tree = build_heap(LookupScorer(inner, trie, [math.log(0.9)] * D), 6, D)
    assert len(tree) == len(plain) == 7
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = set()
    for i in range(len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        paths.add(tuple(reversed(path)))
    assert len(paths) == len(tree)  # siblings distinct: shared prefixes merged
    at = trie.nodes(tree)
    assert at[1] >= 0 and tokens[1] == right[0]  # the drafter's first child is also the chains' first token
    assert tuple(right[:3]) in paths and (right[0], right[1], 30) in paths
    assert sum(a >= 0 for a in at[1:]) >= 4


def test_acceptance_is_calibrated_per_depth():
    src = LookupSource(chain_from(1, 6) * 2)
    assert src.log_accept(0) == pytest.approx(math.log(0.5))
    assert src.propose(root=1, max_len=3) == pytest.approx(0.5 + 0.25 + 0.125)  # the chain at the prior's 0.5
    scorer = src.scorer(MarginalScorer(fake_round(successor(chain_from(1, 6)[-1]), 0), 2))
    tree = build_heap(scorer, 6, D)
    at = src.trie.nodes(tree)
    first = at.index(next(a for a in at[1:] if a >= 0))
    taken = src.observe(tree, [0, first])
    assert taken == 1 and src.accepted[0] == 1 and src.verified[0] >= 1
    assert src.log_accept(0) > math.log(0.5)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"method": "ddtree", "lookup": True}, "--method ddtree"),
        ({"method": "dominotree", "builder": "frontier", "lookup": True}, "--builder frontier"),
        ({"method": "dominotree", "cuda_graph": True, "device": "cuda", "lookup": True}, "--cuda-graph"),
        ({"method": "dominotree", "builder": "frontier", "cuda_graph": True, "lookup": True}, "--cuda-graph"),
    ],
)
def test_lookup_refused_where_the_heap_does_not_build(fields, fragment):
    with pytest.raises(DtrtError) as e:
        RunSpec(**fields)
    msg = str(e.value)
    assert "--lookup" in msg and fragment in msg and "\n" not in msg


def test_lookup_reaches_the_spec_with_the_heap_builder():
    spec = resolve_spec(model="smollm2-135m", backend="torch", method="dominotree", lookup=True)
    assert spec.lookup and spec.builder == "heap" and spec.label.startswith("dominotree+lookup@")


def test_bench_grid_gives_lookup_to_the_tree_rows():
    from dtrt.bench.contenders import grid

    specs = grid({"model": "smollm2-135m", "backend": "torch"}, ["ddtree", "dominotree"], [4], [None], lookup=True)
    assert [(s.method, s.lookup) for s in specs] == [("ar", False), ("ddtree", False), ("dominotree", True)]


def test_a_round_passing_its_chain_over_verifies_the_root_alone():
    """The policy's kinds, whatever it measures: a root-alone round verifies the root alone though a chain was
    proposed (one node), a chain-alone round the chain, and the answer stays AR's; the chain's running acceptance
    learns from the rounds that verified it, not from the root-alone ones."""
    want = fake_pipeline("ar").generate(repeating(), NEW, SamplingConfig()).tokens
    pipe = fake_pipeline("dominotree", lookup=True, budget=BUDGET)
    script = iter(["root", "chain", "draft"] * NEW)
    kinds, learned = [], []

    def choose(expected, now, length=0):
        kinds.append(next(script) if expected > 0 else "bare")
        return kinds[-1]

    for policy in pipe.method.policies.values():
        policy.choose = choose
    observe = pipe.method.observe

    def counted(tree, accepted):
        before = sum(pipe.method.lookup.verified.values())
        taken = observe(tree, accepted)
        learned.append(sum(pipe.method.lookup.verified.values()) - before)
        return taken

    pipe.method.observe = counted
    g = pipe.generate(repeating(), NEW, SamplingConfig())
    assert g.tokens == want and len(kinds) == len(learned) == len(g.rounds)
    rounds = list(zip(g.rounds, kinds, learned))
    root = [(r, n) for r, kind, n in rounds if kind == "root"]
    chain = [(r, n) for r, kind, n in rounds if kind == "chain"]
    assert root and all(r.tree_size == 1 and r.lookup == 0 and n == 0 for r, n in root)
    assert chain and all(r.tree_size > 1 and n > 0 for r, n in chain)
    assert sum(r.lookup for r, _ in chain) > 0  # chains accepted

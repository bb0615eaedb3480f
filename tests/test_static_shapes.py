"""--static-shapes on the torch backend (CPU): every verify at a fixed width over a static cache, the tree padded with
dead leaves, mask, positions, accept walk and commit as device tensors (dtrt.runtime.static_round). The rounds give
AR's tokens with drafts accepted, dead leaves are never accepted, the static cache holds what the growing one holds,
and the round's device part compiles whole (torch.compile fullgraph=True). The CUDA graphs are the `gpu` test's."""

import pytest
import torch
from helpers import PROMPTS, pipe_for, spec

from dtrt.errors import DtrtError
from dtrt.models.drafter import DraftCache
from dtrt.models.static_kv import StaticKVCache
from dtrt.runtime.sampling import SamplingConfig, uniforms
from dtrt.runtime.static_round import WIDTHS, ContextAppend, Sampled, ancestors, device_round, padded, walk, width_for
from dtrt.tree import Tree, accept

CONTEXT = 256  # the static cache's context limit in these tests (the tiny target's 4,096 makes every call longer)
MAX_NEW = 32


def pipe(pair, method, **fields):
    p = pipe_for(pair, spec(method, **fields))
    p.backend.max_context = CONTEXT
    return p


def tokens_of(p, sampling=None):
    sampling = sampling or SamplingConfig()
    gens = [p.generate(p.tokenizer.encode(t, add_special_tokens=False), MAX_NEW, sampling) for t in PROMPTS[:3]]
    return [g.tokens for g in gens], [g.tau for g in gens]


@pytest.fixture(scope="module")
def ar_tokens(tiny):
    return tokens_of(pipe(tiny, "ar"))[0]


@pytest.mark.parametrize("method", ["dominotree", "ddtree", "dflash", "lookup"])
def test_padded_fixed_width_verify_gives_ar_tokens_with_drafts_accepted(tiny, ar_tokens, method):
    p = pipe(tiny, method, static_shapes=True)
    tokens, taus = tokens_of(p)
    assert tokens == ar_tokens
    assert sum(taus) / len(taus) > 1
    assert isinstance(p.backend.cache, StaticKVCache) and p.backend.cache.capacity == CONTEXT


def test_round_appends_the_drafter_context_as_the_loop_does(tiny):
    """The fused round writes the accepted rows' drafter context itself: after the same generation the draft cache
    holds what the loop's own appends hold (1e-4: the static verify's hidden rows round differently), every
    committed position's, and the loop added none of its own but the prefill's."""
    prompt = list(range(5, 25))
    plain, static = pipe(tiny, "dominotree"), pipe(tiny, "dominotree", static_shapes=True)
    calls = []
    real = static.backend.draft_context
    static.backend.draft_context = lambda *a: calls.append(a[1].numel()) or real(*a)
    want, got = (p.generate(prompt, MAX_NEW, SamplingConfig()) for p in (plain, static))
    assert got.tokens == want.tokens and got.tau > 1
    assert calls == [len(prompt)], "only the prefill's context comes from the loop"
    a, b = plain.backend.draft_cache, static.backend.draft_cache
    assert b.length == static.backend.past == plain.backend.past
    assert len(prompt) < a.length < b.length  # the loop's last round is still pending: it appends lazily
    torch.testing.assert_close(b.k[:, :, : a.length], a.k[:, :, : a.length], rtol=0, atol=1e-4)
    torch.testing.assert_close(b.v[:, :, : a.length], a.v[:, :, : a.length], rtol=0, atol=1e-4)


def test_a_longer_generation_after_a_short_one(tiny):
    """The static target cache is allocated once for the context limit; the draft cache follows it (with the
    round's slack), not the first generation's need."""
    p = pipe(tiny, "dominotree", static_shapes=True)
    p.generate([5, 6], 2, SamplingConfig())
    long = list(range(5, 105))
    assert p.generate(long, 64, SamplingConfig()).tokens == pipe(tiny, "ar").generate(long, 64, SamplingConfig()).tokens
    assert p.backend.draft_cache.capacity == CONTEXT + WIDTHS[-1]


def test_widths_and_padding():
    assert [width_for(n) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError):
        width_for(WIDTHS[-1] + 1)
    tree = Tree.from_parents(torch.tensor([9, 4, 5, 6, 7]), [-1, 0, 0, 1, 3])
    tokens, parents = padded(tree, 8)
    assert parents[5:].tolist() == [-1] * 3
    mask = ancestors(parents)
    assert torch.equal(mask[:5, :5], tree.mask)
    assert torch.equal(mask[5:], torch.eye(8, dtype=torch.bool)[5:])  # a dead leaf sees only itself
    assert not mask[:5, 5:].any()  # and no node sees it
    on = Tree(*(t.to("meta") for t in (tree.tokens, tree.parents, tree.depths, tree.scores, tree.mask)))
    assert {t.device.type for t in padded(on, 8)} == {"meta"}  # a drafting graph's tree stays where it is


def test_device_walk_is_the_host_walk():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n = int(torch.randint(1, 16, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tree = Tree.from_parents(torch.randint(0, 4, (n,), generator=g), parents)
        tokens, parents = padded(tree, width_for(n))
        choice = torch.randint(0, 4, (len(tokens),), generator=g)
        accepted, bonus = accept(tree, choice[:n])
        got, order, count, dbonus = walk(tokens, parents, ancestors(parents), choice)
        assert got.nonzero()[:, 0].tolist() == accepted and order[:count].tolist() == accepted
        assert int(dbonus) == bonus


def test_dead_leaves_are_never_accepted():
    """A dead leaf carrying the very token the target chooses at the root: the root's own child is not it."""
    tokens = torch.tensor([3, 8, 5, 5])  # root, a live child (8), two dead leaves carrying 5
    parents = torch.tensor([-1, 0, -1, -1])
    choice = torch.tensor([5, 1, 5, 5])  # the target chooses 5 at the root, and at the dead leaves
    accepted, order, count, bonus = walk(tokens, parents, ancestors(parents), choice)
    assert accepted.tolist() == [True, False, False, False] and int(count) == 1 and int(bonus) == 5


def test_dead_leaf_with_the_targets_token_in_a_real_round(tiny):
    p = pipe(tiny, "ar")
    backend = p.backend
    prompt = p.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    ar = p.generate(prompt, 2, SamplingConfig()).tokens
    cache = StaticKVCache(backend.target.cfg, CONTEXT, WIDTHS[-1], backend.target.dtype)
    n = len(prompt)
    backend.target(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
    cache.commit(list(range(n)))
    tokens = torch.tensor([ar[0], ar[1], ar[1], ar[1]])  # root, then three dead leaves holding AR's next token
    parents = torch.tensor([-1, -1, -1, -1])
    _, _, order, count, bonus = device_round(backend.target, cache, (), tokens, parents)
    assert int(count) == 1 and order[0] == 0 and int(bonus) == ar[1] and int(cache.length) == n + 1


def _prefilled(target, cache, prompt):
    n = len(prompt)
    target(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
    cache.commit(list(range(n)))


def test_static_cache_equals_the_growing_one(tiny):
    """The same trees verified through both caches: the prefill's K/V bit for bit (the same call), then the same
    accepted paths, bonus tokens and committed positions. After a verify the entries agree to 1e-4, not bit for bit:
    SDPA over the whole buffer, the tree in the tail, rounds differently from SDPA over the past and the tree alone
    (on the CPU neither layout of a masked buffer is bit for bit the short call). The commit itself moves entries
    exactly (next test)."""
    target = pipe(tiny, "ar").backend.target
    prompt = list(range(5, 25))
    grow, static = target.new_cache(CONTEXT), StaticKVCache(target.cfg, CONTEXT, WIDTHS[-1], target.dtype)
    _prefilled(target, grow, prompt)
    _prefilled(target, static, prompt)
    n = len(prompt)
    assert torch.equal(grow.k[:, :, :n], static.k[:, :, :n]) and torch.equal(grow.v[:, :, :n], static.v[:, :, :n])
    root = 7
    for _ in range(6):
        tree = Tree.from_parents(torch.tensor([root, 11, 12, 13, 14]), [-1, 0, 0, 1, 2])
        start = grow.past
        logits, _ = target(tree.tokens, tree.positions(start), tree.mask, grow)
        accepted, bonus = accept(tree, logits.argmax(-1))
        grow.commit(accepted)
        tokens, parents = padded(tree, width_for(len(tree)))
        slogits, _, order, count, sbonus = device_round(target, static, (), tokens, parents)
        static.past += int(count)
        assert order[:count].tolist() == accepted and int(sbonus) == bonus
        torch.testing.assert_close(slogits[: len(tree)], logits, rtol=0, atol=1e-4)
        root = bonus
    past = grow.past
    assert int(static.length) == past
    torch.testing.assert_close(static.k[:, :, :past], grow.k[:, :, :past], rtol=0, atol=1e-4)
    torch.testing.assert_close(static.v[:, :, :past], grow.v[:, :, :past], rtol=0, atol=1e-4)


def test_commit_moves_the_same_entries_bit_for_bit(tiny):
    """The static commit (a gather from the tail) against KVCache's (a gather after the past), on the same K/V."""
    target = pipe(tiny, "ar").backend.target
    grow, static = target.new_cache(CONTEXT), StaticKVCache(target.cfg, CONTEXT, 8, target.dtype)
    for cache in (grow, static):
        _prefilled(target, cache, list(range(5, 15)))
    new_k, new_v = torch.randn(2, *grow.k.shape[:2], 8, grow.k.shape[-1])
    grow.k[:, :, 10:18], grow.v[:, :, 10:18] = new_k, new_v
    static.k[:, :, CONTEXT:], static.v[:, :, CONTEXT:] = new_k, new_v
    accepted = [0, 2, 5]
    grow.commit(accepted)
    static.commit_order(torch.tensor(accepted + [1, 3, 4, 6, 7]), torch.tensor(3))
    assert int(static.length) == grow.past == 13
    assert torch.equal(static.k[:, :, :13], grow.k[:, :, :13]) and torch.equal(static.v[:, :, :13], grow.v[:, :, :13])


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_rounds_run_on_the_device_and_give_ar_tokens(tiny, top_p):
    """At T>0 the fused round draws every row's token on the device, at the position it lands at, so no verify goes
    to the host walk; with the same seed DominoTree under --static-shapes commits AR's tokens (the plain path's),
    drafts accepted."""
    sampling = SamplingConfig(temperature=1.0, top_p=top_p, seed=3)
    ar = tokens_of(pipe(tiny, "ar"), sampling)[0]
    p = pipe(tiny, "dominotree", static_shapes=True)
    verifies = []
    real = p.backend.static.verify
    p.backend.static.verify = lambda *a: verifies.append(1) or real(*a)
    tokens, taus = tokens_of(p, sampling)
    assert tokens == ar and sum(taus) / len(taus) > 1.2
    assert verifies == []


def _round_inputs(tiny):
    target = pipe(tiny, "ar").backend.target
    caches = []
    for _ in range(2):
        cache = StaticKVCache(target.cfg, 32, 8, target.dtype)
        _prefilled(target, cache, list(range(5, 11)))
        caches.append(cache)
    tokens = torch.tensor([5, 7, 9, 7, 11, 0, 0, 0])
    parents = torch.tensor([-1, 0, 0, 1, 3, -1, -1, -1])
    return target, caches, tokens, parents


def _context(tiny):
    """A drafter context append over a draft cache holding 6 committed positions."""
    drafter = pipe(tiny, "dominotree").backend.drafter
    cache = DraftCache(drafter.cfg, 32, drafter.dtype)
    cache.length = 6
    context = ContextAppend(drafter, cache)
    context.length.fill_(6)
    return context


def _sampled(mode, capacity, device="cpu"):
    """The T>0 draws of a round ("sample": top_p 1, "nucleus": top_p 0.9) over a table of uniforms; None: T=0."""
    if mode is None:
        return None
    table = torch.from_numpy(uniforms(3, capacity + WIDTHS[-1] + 1)).to(device)
    top_p = 0.9 if mode == "nucleus" else 1.0
    return Sampled(table, torch.tensor(0.8, device=device), torch.tensor(top_p, device=device), nucleus=top_p < 1)


def _compiled_equals_eager(tiny, backend, exact, mode=None):
    """The round with the drafter's context append: the tiny drafter taps layers 0 and 1."""
    target, (eager, compiled), tokens, parents = _round_inputs(tiny)
    contexts = _context(tiny), _context(tiny)
    sampled = _sampled(mode, eager.capacity)
    fn = torch.compile(device_round, fullgraph=True, backend=backend)  # a graph break or a host sync raises
    with torch.no_grad():
        got = fn(target, compiled, (0, 1), tokens, parents, contexts[1], sampled)
        want = device_round(target, eager, (0, 1), tokens, parents, contexts[0], sampled)
    for g, w in zip(got, want):
        assert torch.equal(g, w) if exact or g.dtype == torch.long else torch.allclose(g, w, rtol=0, atol=1e-5)
    assert torch.equal(compiled.length, eager.length)
    torch.testing.assert_close(compiled.k, eager.k, rtol=0, atol=0 if exact else 1e-5)
    assert int(contexts[0].length) == 6 + int(want[3]) == int(contexts[1].length)
    torch.testing.assert_close(contexts[1].cache.k, contexts[0].cache.k, rtol=0, atol=0 if exact else 1e-5)
    torch.testing.assert_close(contexts[1].cache.v, contexts[0].cache.v, rtol=0, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("mode", [None, "sample", "nucleus"])
def test_round_compiles_whole(tiny, mode):
    """torch.compile(fullgraph=True) traces the round whole (Dynamo and AOTAutograd; bit for bit the eager round),
    at T=0 and with the T>0 draws at every row, with and without a nucleus."""
    torch._dynamo.reset()
    _compiled_equals_eager(tiny, "aot_eager", exact=True, mode=mode)


@pytest.mark.slow
def test_round_compiles_with_inductor(tiny):
    torch._dynamo.reset()
    _compiled_equals_eager(tiny, "inductor", exact=False)


@pytest.fixture
def fresh_parts():
    """compiled_parts made afresh for the test, and again after it (they are cached per process)."""
    from dtrt.models.static_kv import compiled_parts

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled_parts.cache_clear()
    yield
    compiled_parts.cache_clear()


@pytest.mark.slow
def test_compiled_layers_serve_every_layer_and_width(tiny, fresh_parts):
    """--static-shapes compiles a layer's parts around attention with Inductor (on CUDA; here on the CPU): one compile
    of each part serves the four layers and widths 8, 4 and 2, each round equal to the uncompiled one, the caches
    included."""
    target = pipe(tiny, "ar").backend.target
    drafter = pipe(tiny, "dominotree").backend.drafter
    taps = tuple(drafter.cfg.target_layer_ids)
    graphs = []
    for width in (8, 4, 2):
        states = []
        for compiled in (True, False):
            cache = StaticKVCache(target.cfg, 1000, WIDTHS[-1], target.dtype, compiled=compiled)
            _prefilled(target, cache, list(range(5, 11)))
            draft = DraftCache(drafter.cfg, 1000 + WIDTHS[-1], drafter.dtype)
            draft.length = 6
            context = ContextAppend(drafter, draft)
            context.length.fill_(6)
            states.append((cache, context))
        tokens, parents = torch.tensor([5, 7, 9, 7, 11, 0, 0, 0]), torch.tensor([-1, 0, 0, 1, 3, -1, -1, -1])
        with torch.no_grad():
            got, want = (device_round(target, c, taps, tokens[:width], parents[:width], x) for c, x in states)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        (a, ca), (b, cb) = states
        for x, y in ((a.k, b.k), (a.v, b.v), (ca.cache.k, cb.cache.k)):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        assert torch.equal(a.length, b.length) and torch.equal(ca.length, cb.length)
    assert graphs == [2, 2, 2], "each part compiles once, for every layer and width"


def test_compiled_rounds_give_ar_tokens(tiny, ar_tokens, monkeypatch, fresh_parts):
    """The decode loop through compiled layer parts (AOTAutograd here, to keep the test fast; Inductor: the test
    above), T=0 rounds with the drafter's context and a T=1 generation's rounds (every row drawn in the round): AR's
    tokens, drafts accepted, the seed's tokens."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **kw, backend="aot_eager"))
    p = pipe(tiny, "dominotree", static_shapes=True)
    backend = p.backend
    backend.compile_layers = True  # on the CPU too: prepare compiles only on CUDA
    tokens, taus = tokens_of(p)
    assert backend.cache.compiled and tokens == ar_tokens and sum(taus) / len(taus) > 1
    sampling = SamplingConfig(temperature=1.0, seed=3)
    assert tokens_of(p, sampling)[0] == tokens_of(pipe(tiny, "dominotree"), sampling)[0]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2


def test_static_shapes_refusals(tiny):
    with pytest.raises(DtrtError, match="--static-shapes: the torch backend"):
        spec("dominotree", static_shapes=True, backend="onnxruntime")
    from dtrt.zoo.registry import tiny_hybrid_pair

    with pytest.raises(DtrtError, match="recurrent layers"):
        pipe_for(tiny_hybrid_pair(), spec("dominotree", static_shapes=True))


@pytest.mark.gpu
def test_captured_rounds_give_ar_tokens_on_cuda(tiny):
    """One CUDA graph per width, captured at first use and replayed: AR's tokens, drafts accepted."""
    ar = tokens_of(pipe_for(tiny, spec("ar"), device="cuda"))[0]
    p = pipe_for(tiny, spec("dominotree", static_shapes=True), device="cuda")
    p.backend.max_context = CONTEXT
    tokens, taus = tokens_of(p)
    assert tokens == ar and sum(taus) / len(taus) > 1
    assert {key[0] for key in p.backend.static.graphs} == {"round"}
    for top_p, mode in ((1.0, "sample"), (0.9, "nucleus")):  # T>0: each row drawn inside the round's graph
        sampled = SamplingConfig(temperature=1.0, top_p=top_p, seed=3)
        want = tokens_of(pipe_for(tiny, spec("ar"), device="cuda"), sampled)[0]
        assert tokens_of(p, sampled)[0] == want
        assert {key[3] for key in p.backend.static.graphs} >= {None, mode}
    assert {key[0] for key in p.backend.static.graphs} == {"round"}


READS = ("tolist", "item", "__int__", "__bool__", "__index__", "__float__", "numpy")


def _count_reads(monkeypatch, counts):
    """Every read of a tensor's values on the host, counted by the function that made it."""
    import sys

    for name in READS:
        real = getattr(torch.Tensor, name)

        def read(self, *a, _real=real, **k):
            frame = sys._getframe(1)
            counts[frame.f_code.co_name] = counts.get(frame.f_code.co_name, 0) + 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0, 0.9, 3)], ids=["T=0", "T=1"])
def test_a_graph_round_reads_the_device_once(tiny, monkeypatch, sampling):
    """DominoTree with the drafting graph and the fused round (what --cuda-graph --static-shapes runs on CUDA, here
    eagerly): each round's only host read is the fused round's read-back; the drafting graph's tree goes to the
    verify whole, padding leaves included, with nothing counted on the host, and the loop takes the committed tokens
    from the read-back, not from the tree. Each fused round queues the next round's drafting from its own outputs
    (DraftGraph.launch), and the next round takes it: one drafting for the first round, then one per round. At
    T>0 too: every row's token is drawn inside the round, on the device."""
    from dtrt.runtime.draft_graph import DraftGraph
    from dtrt.runtime.generate import generate
    from dtrt.runtime.methods import make_method

    run = spec("dominotree", budget=8, builder="frontier", static_shapes=True)
    p = pipe(tiny, "dominotree", budget=8, builder="frontier", static_shapes=True)
    method = make_method(spec("dominotree", budget=8, builder="frontier", cuda_graph=True, device="cuda"))
    prompt = list(range(5, 25))
    want = pipe(tiny, "ar").generate(prompt, MAX_NEW, sampling).tokens
    plain = [r.accepted for r in p.generate(prompt, MAX_NEW, sampling).rounds]  # drafting in the loop
    drafted = []
    real = DraftGraph.step
    monkeypatch.setattr(DraftGraph, "step", lambda self: drafted.append(1) or real(self))
    steps = generate(p.backend, method, prompt, MAX_NEW, sampling, p.eos, run.budget)
    tokens = next(steps).tokens
    counts = {}
    with monkeypatch.context() as mp:
        _count_reads(mp, counts)
        rounds = [step for step in steps]
    tokens += [t for step in rounds for t in step.tokens]
    assert isinstance(method.graph, DraftGraph)
    assert tokens == want and sum(len(s.tokens) for s in rounds) > 1.5 * len(rounds)
    assert [s.stats.accepted for s in rounds] == plain  # the queued drafting is the round's own
    assert counts == {"round": len(rounds)}
    assert len(drafted) == 1 + len(rounds)  # the last round's queued drafting goes unused
    assert method.graph.queued is not None
    method.prepare(p.backend, p.backend.drafter.cfg.k_draft)  # the next generation drops it
    assert method.graph.queued is None


def _on_meta(module):
    import copy

    return copy.deepcopy(module).to("meta")


class _HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that take a host tensor of more than one element into a step on another device (a copy from
    pageable host memory, which a CUDA graph cannot capture)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.numel() > 1 for t in tensors) and any(
            t.device.type == "meta" for t in tensors
        ):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("mode", [None, "nucleus"])
def test_the_captured_steps_run_on_a_device_the_host_cannot_read(tiny, mode):
    """The drafting graph's step and the fused round's step on the meta device, which has shapes and no values: a
    host read inside either (.item(), .tolist(), a data-dependent shape) raises, as it would break a CUDA graph's
    capture, and no host tensor is copied in. Then the tree goes from one step to the other as on CUDA. At T=0 and
    with the T>0 draws under a nucleus."""
    from dtrt.runtime.backends.torch import TorchBackend
    from dtrt.runtime.draft_graph import DraftGraph
    from dtrt.runtime.methods import make_method

    cpu = pipe(tiny, "dominotree", budget=8, builder="frontier").backend
    run = spec("dominotree", budget=8, builder="frontier", static_shapes=True)
    backend = TorchBackend(_on_meta(cpu.target), _on_meta(cpu.drafter), "meta", CONTEXT, draft_vocab=cpu.draft_vocab)
    backend.prepare(run)
    backend.reset(64)
    method = make_method(run)
    method.prepare(backend, backend.drafter.cfg.k_draft)
    graph, context = DraftGraph(backend, method), ContextAppend(backend.drafter, backend.draft_cache)
    sampled = _sampled(mode, backend.cache.capacity, "meta")

    def round_():
        tree = graph(42, 20)
        assert tree.tokens.device.type == "meta" and len(tree) == run.budget + 1
        tokens, parents = padded(tree, width_for(len(tree)))
        return device_round(backend.target, backend.cache, backend.taps, tokens, parents, context, sampled)

    copies = _HostCopies()
    with torch.no_grad():
        round_()  # as a capture's warm-up: the first calls make their per-device constants (the rotary tables)
        with copies:
            out = round_()
    assert {t.device.type for t in out} == {"meta"}
    assert copies.ops == []


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0, 0.9, 3)], ids=["T=0", "T=1"])
def test_a_graph_round_synchronizes_once_on_cuda(tiny, sampling):
    """`dtrt run --device cuda --cuda-graph --static-shapes` as it runs (both graphs replayed, the layers compiled):
    CUDA's own sync check (torch.cuda.set_sync_debug_mode) counts no more than one synchronization a round once the
    graphs are captured (the read-back waits on an event, which it may not count); AR's tokens, drafts accepted."""
    import warnings

    from dtrt.runtime.generate import generate

    run = spec("dominotree", budget=8, builder="frontier", cuda_graph=True, static_shapes=True)
    p = pipe_for(tiny, run, device="cuda")
    p.backend.max_context = CONTEXT
    prompt = list(range(5, 25))
    want = pipe_for(tiny, spec("ar"), device="cuda").generate(prompt, MAX_NEW, sampling).tokens
    assert p.generate(prompt, MAX_NEW, sampling).tokens == want  # captures the graphs it replays below
    steps = generate(p.backend, p.method, prompt, MAX_NEW, sampling, p.eos, run.budget)
    tokens = next(steps).tokens
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rounds = list(steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    tokens += [t for step in rounds for t in step.tokens]
    assert tokens == want and sum(len(s.tokens) for s in rounds) > 1.5 * len(rounds)
    assert len([w for w in syncs if "synchroniz" in str(w.message)]) <= len(rounds)


def test_a_compile_that_fails_is_one_line_naming_no_compile(tiny, fresh_parts):
    """A machine where Inductor cannot compile (here: no C++ compiler by that name) stops the run with a fault that
    names --no-compile, not a compiler's traceback."""
    from dtrt.errors import BackendFault

    p = pipe(tiny, "dominotree", static_shapes=True)
    p.backend.compile_layers = True  # on the CPU too: prepare compiles only on CUDA
    broken = {"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False, "force_disable_caches": True}
    with torch._inductor.config.patch(broken), pytest.raises(BackendFault, match=r"--compile: .*run with --no-compile"):
        p.generate([5, 6, 7, 8], 4, SamplingConfig())

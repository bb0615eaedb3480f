"""`--cuda-graph`: the fixed-shape draft block and frontier build that DraftGraph captures. On the CPU the step
runs eagerly: it must match the plain round, read no host values, and give the AR tokens with the same
acceptance. The capture itself is checked by the `gpu` test."""

import pytest
import torch
from helpers import no_host_sync, pipe_for, spec

from dtrt.errors import DtrtError
from dtrt.runtime.draft_graph import DraftGraph
from dtrt.runtime.generate import collect, generate
from dtrt.runtime.methods import make_method
from dtrt.runtime.sampling import SamplingConfig
from dtrt.zoo.registry import tiny_hybrid_pair

PROMPT = list(range(5, 25))
GRAPH = spec("dominotree", budget=8, builder="frontier", cuda_graph=True, device="cuda")  # run eagerly off CUDA


@pytest.fixture(scope="module")
def hybrid():
    return tiny_hybrid_pair()


def _prefilled(pair):
    """A torch pipeline whose backend has run a few rounds (so the draft cache is part full) and a DraftGraph."""
    pipe = pipe_for(pair, spec("dominotree", budget=8, builder="frontier"))
    pipe.generate(PROMPT, 12, SamplingConfig())
    method = make_method(GRAPH)
    method.prepare(pipe.backend, pipe.backend.drafter.cfg.k_draft)
    return pipe.backend, method


def test_fixed_shape_block_matches_the_block(tiny):
    backend, _ = _prefilled(tiny)
    cache = backend.draft_cache
    assert 0 < cache.length < cache.capacity
    cache.k[:, :, cache.length :] = 1e4 * torch.randn_like(cache.k[:, :, cache.length :])  # stale entries past it
    cache.v[:, :, cache.length :] = 1e4
    root, start = 42, backend.past
    want = backend.draft_block(root, start, rows=backend.drafter.cfg.k_draft)
    got = backend.draft_block_fixed(torch.tensor([root]), torch.tensor([start]), torch.tensor([cache.length]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    wrong = backend.draft_block_fixed(torch.tensor([root]), torch.tensor([start]), torch.tensor([cache.length + 1]))
    assert not torch.allclose(wrong[0], want[0], atol=1e-3), "the length mask decides what the block sees"


def test_step_reads_no_host_values(tiny, monkeypatch):
    backend, method = _prefilled(tiny)
    graph = method.graph
    graph.root.fill_(42)
    graph.start.fill_(backend.past)
    graph.length.fill_(backend.draft_cache.length)
    want = graph.step()  # as the capture's warm-up does: first calls may build cached constants
    with monkeypatch.context() as mp:
        no_host_sync(mp)
        for name in ("tensor", "as_tensor"):  # a copy from the host cannot be captured
            mp.setattr(torch, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("host tensor")))
        got = graph.step()
    for name in ("tokens", "parents", "depths", "scores", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_graph_rounds_give_the_ar_tokens_and_the_same_acceptance(name, tiny, hybrid):
    pair = tiny if name == "tiny" else hybrid
    pipe = pipe_for(pair, spec("dominotree", budget=8, builder="frontier"))
    ar = pipe_for(pair, spec("ar")).generate(PROMPT, 48, SamplingConfig()).tokens
    plain = pipe.generate(PROMPT, 48, SamplingConfig())
    method = make_method(GRAPH)
    got = collect(generate(pipe.backend, method, PROMPT, 48, SamplingConfig(), pipe.eos, GRAPH.budget))
    assert isinstance(method.graph, DraftGraph)
    assert got.tokens == plain.tokens == ar and got.tau > 2
    assert [r.accepted for r in got.rounds] == [r.accepted for r in plain.rounds]


def test_cuda_graph_flag_errors(tiny):
    with pytest.raises(
        DtrtError,
        match=r"^--cuda-graph: captures DominoTree's fixed-shape frontier build, not "
        r"--method ddtree; use --method dominotree --builder frontier$",
    ):
        spec("ddtree", cuda_graph=True)
    with pytest.raises(DtrtError, match=r"not --builder heap; use --method dominotree --builder frontier$"):
        spec("dominotree", builder="heap", cuda_graph=True)
    with pytest.raises(
        DtrtError,
        match=r"^--cuda-graph: captures the torch backend's drafting on a GPU; add "
        r"--device cuda$",
    ):
        pipe_for(tiny, GRAPH)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-hybrid"])
def test_cuda_graph_on_the_gpu(name, tiny, hybrid, monkeypatch):
    pair = tiny if name == "tiny" else hybrid
    ar = pipe_for(pair, spec("ar")).generate(PROMPT, 48, SamplingConfig()).tokens
    plain = pipe_for(pair, spec("dominotree", budget=8, builder="frontier"), device="cuda")
    pipe = pipe_for(pair, GRAPH, device="cuda")
    captures = []
    real = DraftGraph._capture
    monkeypatch.setattr(DraftGraph, "_capture", lambda self: captures.append(1) or real(self))
    want = plain.generate(PROMPT, 48, SamplingConfig())
    for n in (48, 48, 200):  # the same cache twice, then a larger one: captured once per draft cache
        got = pipe.generate(PROMPT, n, SamplingConfig())
        assert got.tokens[:48] == want.tokens == ar
        assert got.tau > 2
    assert len(captures) == 2


def test_padding_leaves_change_nothing(tiny):
    """One child per node (node_topk 1) reaches the drafter's depth alone, so a budget of 16 leaves padding slots:
    the drafting graph hands them to the verify as leaves under the root (it does not read the device to count the
    real nodes), and the rounds still give AR's tokens with the plain path's acceptance."""
    run = dict(budget=16, builder="frontier", node_topk=1)
    pipe = pipe_for(tiny, spec("dominotree", **run))
    ar = pipe_for(tiny, spec("ar")).generate(PROMPT, 48, SamplingConfig()).tokens
    plain = pipe.generate(PROMPT, 48, SamplingConfig())
    method = make_method(spec("dominotree", **run, cuda_graph=True, device="cuda"))
    got = collect(generate(pipe.backend, method, PROMPT, 48, SamplingConfig(), pipe.eos, 16))
    assert got.tokens == plain.tokens == ar and got.tau > 2
    assert [r.accepted for r in got.rounds] == [r.accepted for r in plain.rounds]
    depth = pipe.backend.drafter.cfg.k_draft
    assert max(r.tree_size for r in plain.rounds) <= depth + 1 < 17 == min(r.tree_size for r in got.rounds)


def test_a_capture_that_fails_is_one_line_naming_the_flag():
    """Whatever breaks a CUDA graph's warm-up or capture is a fault that names the option to drop (here the CPU
    build's own refusal of a CUDA stream)."""
    from dtrt.errors import BackendFault
    from dtrt.runtime.capture import capture

    why = r"^--cuda-graph: capturing the step's CUDA graph failed \(.+\); run without --cuda-graph$"
    with pytest.raises(BackendFault, match=why):
        capture(lambda: None, device=torch.device("cuda"), flag="--cuda-graph")

"""The static verify's split attention kernel (dtrt.plugins.static_tree_attention), in Triton's CPU interpreter:
the reference's answer for every committed length (none, a partial split, the whole capacity), tree widths with
dead leaves, GQA groups and query rows over several row blocks; a grid fixed by the shapes alone; and, inside the
decode loop under --static-shapes, AR's tokens with drafts accepted. On a GPU the `gpu` test of
test_static_shapes.py runs it under CUDA graph capture."""

import importlib.util
import os

import pytest
import torch
from helpers import PROMPTS, pipe_for, spec

from dtrt.ops.tree_attention import tree_attention_ref
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.static_round import ancestors

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.kernels
interpreted = pytest.mark.skipif(
    not HAVE_TRITON or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernel in Triton's CPU interpreter: needs Triton, no CUDA GPU",
)


def _case(*, heads, kv_heads, head_dim, capacity, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 64
    k_buf, v_buf = torch.randn(2, kv_heads, capacity + width, head_dim, generator=g)
    k, v = k_buf[:, : capacity + n], v_buf[:, : capacity + n]  # update's views: heads strided, not packed
    q = torch.randn(heads, n, head_dim, generator=g)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    if n > 2:
        parents[-1] = -1  # a dead leaf
    tree = ancestors(torch.tensor(parents))
    mask = torch.cat(((torch.arange(capacity) < length).expand(n, capacity), tree), -1)
    return q, k, v, torch.tensor(length), tree, mask


@interpreted
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,capacity,n,length",
    [
        (4, 2, 16, 100, 1, 0),  # the past empty: only the tree's split has columns
        (4, 2, 16, 100, 1, 37),  # a length that ends inside a split
        (4, 2, 16, 100, 3, 100),  # the whole capacity committed
        (4, 2, 16, 100, 8, 64),
        (8, 2, 32, 300, 64, 299),  # 256 query rows per K/V head: four row blocks
        (4, 4, 16, 50, 5, 13),  # no GQA
        (6, 2, 24, 90, 2, 90),  # a head_dim that is no power of two
    ],
)
def test_kernel_equals_the_reference(heads, kv_heads, head_dim, capacity, n, length):
    from dtrt.plugins.static_tree_attention import run

    q, k, v, length_t, tree, mask = _case(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, capacity=capacity, n=n, length=length
    )
    c = capacity
    got = run(q, k[:, :c], v[:, :c], length_t, k[:, c:], v[:, c:], tree)
    torch.testing.assert_close(got, tree_attention_ref(q, k, v, mask), rtol=0, atol=2e-6)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
def test_grid_depends_on_shapes_alone():
    """One captured call serves every length: the launch is a function of the shapes; the splits fill what the
    rows leave of about PROGRAMS programs."""
    from dtrt.plugins.static_tree_attention import PROGRAMS, config

    few = config(head_dim=128, groups=4, n_q=1, kv_heads=8, dtype=torch.bfloat16).constexprs
    many = config(head_dim=128, groups=4, n_q=64, kv_heads=8, dtype=torch.bfloat16).constexprs
    assert few["SPLITS"] == PROGRAMS // 8 and few["BLOCK_R"] == 16
    assert many["BLOCK_R"] == 64 and many["SPLITS"] == PROGRAMS // (4 * 8)


@interpreted
def test_new_keys_of_any_layout():
    """The block's own K/V come from a projection, transposed (heads strided by head_dim): read as they lie."""
    from dtrt.plugins.static_tree_attention import run

    q, k, v, length, _, _ = _case(heads=4, kv_heads=2, head_dim=16, capacity=40, n=6, length=21)
    new_k, new_v = (t[:, 40:].transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v))
    whole = torch.ones(6, 6, dtype=torch.bool)
    mask = torch.cat(((torch.arange(40) < 21).expand(6, 40), whole), -1)
    got = run(q, k[:, :40], v[:, :40], length, new_k, new_v, whole)
    torch.testing.assert_close(got, tree_attention_ref(q, k, v, mask), rtol=0, atol=2e-6)


@pytest.fixture
def launched(monkeypatch):
    """The ops whose kernels ran."""
    import dtrt.ops.kernels as kernels

    ops, real = set(), kernels._launcher
    monkeypatch.setattr(kernels, "_launcher", lambda op: ops.add(op) or real(op))
    return ops


@interpreted
def test_fixed_draft_block_through_the_kernel(tiny, launched, monkeypatch):
    """--cuda-graph's fixed-shape block over the draft cache's whole capacity (stale entries past its length) gives
    the plain block's rows through the kernel."""
    pipe = pipe_for(tiny, spec("dominotree", budget=8, builder="frontier"))
    pipe.generate(list(range(5, 25)), 12, SamplingConfig())
    backend, cache = pipe.backend, pipe.backend.draft_cache
    cache.k[:, :, cache.length :] = 1e4 * torch.randn_like(cache.k[:, :, cache.length :])
    cache.v[:, :, cache.length :] = 1e4
    root, start = 42, backend.past
    want = backend.draft_block(root, start, rows=backend.drafter.cfg.k_draft)
    monkeypatch.setenv("DTRT_KERNELS", "triton")
    got = backend.draft_block_fixed(torch.tensor([root]), torch.tensor([start]), torch.tensor([cache.length]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert "static_tree_attention" in launched


@interpreted
@pytest.mark.slow
def test_static_rounds_through_the_kernel_give_ar_tokens(tiny, launched, monkeypatch):
    """--static-shapes with every kernel on (DTRT_KERNELS=triton): AR's tokens with drafts accepted, and the
    static verify's attention was the split kernel."""
    tokenizer = pipe_for(tiny, spec("ar")).tokenizer
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS[:2]]

    def run(method, **fields):
        p = pipe_for(tiny, spec(method, **fields))
        p.backend.max_context = 128
        gens = [p.generate(ids, 16, SamplingConfig()) for ids in prompts]
        return [g.tokens for g in gens], sum(g.tau for g in gens) / len(gens)

    want, _ = run("ar")
    monkeypatch.setenv("DTRT_KERNELS", "triton")
    got, tau = run("dominotree", static_shapes=True, budget=4)
    assert got == want and tau > 1
    assert "static_tree_attention" in launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,length", [(1, 0), (1, 1000), (16, 4095), (64, 2500)])
def test_kernel_on_cuda(dtype, atol, n, length):
    """Qwen3-4B's heads (32 query, 8 K/V, head_dim 128) over a 4,096-column past, against the reference in fp32."""
    from dtrt.plugins.static_tree_attention import run

    q, k, v, length_t, tree, mask = _case(heads=32, kv_heads=8, head_dim=128, capacity=4096, n=n, length=length)
    want = tree_attention_ref(q, k, v, mask)
    q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
    got = run(q, k[:, :4096], v[:, :4096], length_t.cuda(), k[:, 4096:], v[:, 4096:], tree.cuda())
    torch.testing.assert_close(got.float().cpu(), want, rtol=0, atol=atol)

"""The Triton kernels of the dtrt plugins against the ops' PyTorch references, on random inputs with tree masks,
ties, unreachable ledger entries and GQA (marked `kernels`). They run on a CUDA GPU, or without one in Triton's
CPU interpreter (conftest.py sets TRITON_INTERPRET=1), where the largest shapes are too slow: those, and bf16
attention (the interpreter's bf16 dot product is not IEEE), are also marked `gpu`."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from dtrt.exporter.stage_modules import random_tree_mask  # noqa: E402
from dtrt.ops.ledger_select import ledger_select_ref  # noqa: E402
from dtrt.ops.topm_corrected_score import topm_corrected_score_ref  # noqa: E402
from dtrt.ops.tree_attention import tree_attention_ref  # noqa: E402
from dtrt.ops.tree_causal_conv1d import tree_causal_conv1d_ref  # noqa: E402
from dtrt.ops.tree_gated_delta_net import tree_gated_delta_net_ref  # noqa: E402
from dtrt.plugins import (  # noqa: E402
    ledger_select,
    topm_corrected_score,
    tree_attention,
    tree_causal_conv1d,
    tree_gated_delta_net,  # noqa: E402
)

pytestmark = pytest.mark.kernels
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def gpu(*values):
    return pytest.param(*values, marks=pytest.mark.gpu)


PARENTS = [-1, 0, 0, 1, -1, 3, 2, 5, 7, 0]  # a forest: two roots continue the committed state


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3), gpu(torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,n,past,head_dim",
    [(4, 2, 17, 40, 24), gpu(32, 8, 33, 300, 128), (8, 8, 1, 0, 64), (4, 1, 200, 0, 64)],
)
def test_tree_attention(dtype, atol, heads, kv_heads, n, past, head_dim):
    g = torch.Generator().manual_seed(n + past)
    q, k, v = (
        torch.randn(h, m, head_dim, generator=g).to(DEV, dtype)
        for h, m in ((heads, n), (kv_heads, past + n), (kv_heads, past + n))
    )
    tree = random_tree_mask(n, g)[1]
    mask = torch.cat((torch.ones(n, past, dtype=torch.bool), tree), 1).to(DEV)
    want = tree_attention_ref(q.float(), k.float(), v.float(), mask)
    got = tree_attention.run(q, k, v, mask)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_tree_attention_over_a_partly_filled_cache(dtype, atol):
    """The fixed-shape draft block's mask: a committed prefix, an unused tail of the capacity (key blocks the
    kernel skips; their stale values must not leak), then the block itself."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, n, cap, length, head_dim = 4, 2, 16, 300, 37, 24
    q = torch.randn(heads, n, head_dim, generator=g)
    k, v = (torch.randn(kv_heads, cap + n, head_dim, generator=g) for _ in range(2))
    k[:, length:cap], v[:, length:cap] = 1e4, -1e4
    cols = torch.arange(cap + n)
    mask = ((cols < length) | (cols >= cap)).expand(n, cap + n)
    q, k, v, mask = (t.to(DEV) for t in (q.to(dtype), k.to(dtype), v.to(dtype), mask))
    want = tree_attention_ref(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(tree_attention.run(q, k, v, mask).float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("bs,n,emb,gru,topm", [(1, 1, 256, 1024, 64), gpu(2, 32, 256, 1024, 64), (3, 5, 24, 40, 300)])
def test_topm_corrected_score(dtype, atol, bs, n, emb, gru, topm):
    g = torch.Generator().manual_seed(bs * n)
    zproj, basec = torch.randn(bs, emb, generator=g), 3 * torch.randn(bs, topm, generator=g)
    states, w1s = torch.randn(bs, n, gru, generator=g), torch.randn(emb, gru, generator=g) / gru**0.5
    w2c = torch.randn(bs, topm, emb, generator=g) / emb**0.5
    args = [t.to(DEV) for t in (zproj, states.to(dtype), w1s.to(dtype), basec, w2c)]
    got = topm_corrected_score.run(*args)
    torch.testing.assert_close(got, topm_corrected_score_ref(*args), atol=atol, rtol=atol)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(bs, n, device=DEV))


def ledger(bs: int, depth: int, wk: int, seed: int):
    """A ledger as the frontier fills it: scores fall with depth, parents sit one depth up, some entries are
    unreachable (-inf) and some scores tie."""
    g = torch.Generator().manual_seed(seed)
    scores = -(torch.rand(bs, depth, wk, generator=g) * 2).cumsum(1)
    scores[scores < -depth] = float("-inf")
    scores[:, 1, : wk // 2] = scores[:, 1, wk // 2, None]
    parents = torch.full((bs, depth, wk), -1)
    for d in range(1, depth):
        parents[:, d] = (d - 1) * wk + torch.randint(0, wk, (bs, wk), generator=g)
    tokens = torch.randint(0, 151936, (bs, depth, wk), generator=g)
    return scores, tokens, parents, torch.randint(0, 151936, (bs,), generator=g)


@pytest.mark.parametrize("bs,depth,wk,budget", [gpu(1, 16, 256, 32), (4, 5, 36, 12), (2, 2, 4, 2), gpu(1, 16, 512, 64)])
def test_ledger_select(bs, depth, wk, budget):
    args = [t.to(DEV) for t in ledger(bs, depth, wk, budget)]
    got = ledger_select.run(*args, budget, 151669)
    for name, a, b in zip(
        ("tokens", "parents", "depths", "scores", "mask"), got, ledger_select_ref(*args, budget, 151669)
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("heads,dk,dv", [(2, 16, 24), (4, 128, 128)])
def test_tree_gated_delta_net(heads, dk, dv):
    g = torch.Generator().manual_seed(dk)
    n = len(PARENTS)
    q, k = (F.normalize(torch.randn(n, heads, dk, generator=g), dim=-1) for _ in range(2))
    v, state0 = torch.randn(n, heads, dv, generator=g), torch.randn(heads, dk, dv, generator=g)
    decay, beta = -torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    args = [t.to(DEV) for t in (q, k, v, decay, beta, torch.tensor(PARENTS), state0)]
    for got, want in zip(tree_gated_delta_net.run(*args), tree_gated_delta_net_ref(*args)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("channels,kernel", [(40, 4), (2560, 4), (300, 2)])
def test_tree_causal_conv1d(dtype, atol, channels, kernel):
    g = torch.Generator().manual_seed(channels)
    n = len(PARENTS)
    x, state = torch.randn(n, channels, generator=g), torch.randn(channels, kernel - 1, generator=g)
    weight = torch.randn(channels, kernel, generator=g) / kernel
    args = [x.to(DEV, dtype), torch.tensor(PARENTS).to(DEV), state.to(DEV, dtype), weight.to(DEV, dtype)]
    for got, want in zip(tree_causal_conv1d.run(*args), tree_causal_conv1d_ref(*args)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.gpu
def test_device_kv_cache():
    from dtrt.runtime.backends.kv import LayerKV, TargetKV

    host, dev = LayerKV(3, 2, 8, 40, torch.float32), LayerKV(3, 2, 8, 40, torch.float32, DEV)
    target_host, target_dev = TargetKV(3, 2, 8, 40, torch.float32), TargetKV(3, 2, 8, 40, torch.float32, DEV)
    for n in (17, 1, 9):
        k, v = torch.randn(3, 2, n, 8), torch.randn(3, 2, n, 8)
        host.append(k, v)
        dev.append(k.to(DEV), v.to(DEV))
        target_host.append(k, v)
        target_dev.append(k.to(DEV), v.to(DEV))
    for a, b in zip(sum(host.view(), []), sum(dev.view(), [])):
        assert torch.equal(a, b.cpu())
    for name, a in target_host.feeds().items():
        assert torch.equal(a, target_dev.feeds()[name].cpu()), name

"""The DFlash drafter and the Domino head against direct computations."""

import torch
from helpers import drafter_json, write_drafter

from dtrt.models.checkpoint import load_drafter
from dtrt.models.drafter import DraftCache


@torch.no_grad()
def test_incremental_context_cache_equals_one_shot(tmp_path):
    drafter = load_drafter(write_drafter(tmp_path / "d", drafter_json(layers=2)))
    feats = torch.randn(20, 128)
    cache = DraftCache(drafter.cfg, 32)
    for lo, hi in ((0, 12), (12, 15), (15, 20)):
        cache.append_layers(drafter.context_kv(feats[lo:hi], torch.arange(lo, hi)))
    x = torch.randn(8, 64)
    pos = torch.arange(20, 28)
    inc = drafter.block(x, pos, [cache.layer(i) for i in range(2)])
    full = drafter.block(x, pos, drafter.context_kv(feats, torch.arange(20)))
    assert (inc - full).abs().max() < 1e-5


@torch.no_grad()
def test_block_sees_context_and_whole_block_without_mask(tmp_path):
    """Changing a later block slot changes earlier rows (bidirectional block); context beyond the cache does not
    exist."""
    drafter = load_drafter(write_drafter(tmp_path / "d", drafter_json()))
    kv = drafter.context_kv(torch.randn(5, 128), torch.arange(5))
    x = torch.randn(8, 64)
    a = drafter.block(x, torch.arange(5, 13), kv)
    x2 = x.clone()
    x2[-1] += 1.0
    b = drafter.block(x2, torch.arange(5, 13), kv)
    assert (a[0] - b[0]).abs().max() > 1e-4


@torch.no_grad()
def test_training_mask_path_equals_inference(tmp_path):
    """The batched training forward (several anchored blocks, masked context) equals one block per anchor."""
    drafter = load_drafter(write_drafter(tmp_path / "d", drafter_json()))
    T, B = 16, 8
    feats = torch.randn(1, T, 128)
    anchors = [3, 9]
    x = torch.randn(1, 2 * B, 64)
    pos = torch.cat([torch.arange(a, a + B) for a in anchors])[None]
    sees_ctx = torch.cat([(torch.arange(T) < a).expand(B, T) for a in anchors])[None]
    sees_blk = torch.block_diag(torch.ones(B, B), torch.ones(B, B)).bool()[None]
    batched = drafter.block(
        x, pos, drafter.context_kv(feats, torch.arange(T)[None]), torch.cat((sees_ctx, sees_blk), -1)
    )[0]
    for i, a in enumerate(anchors):
        one = drafter.block(
            x[0, i * B : (i + 1) * B], pos[0, i * B : (i + 1) * B], drafter.context_kv(feats[0, :a], torch.arange(a))
        )
        assert (batched[i * B : (i + 1) * B] - one).abs().max() < 1e-5


@torch.no_grad()
def test_domino_gru_step_is_torch_gru(tmp_path):
    drafter = load_drafter(write_drafter(tmp_path / "d", drafter_json(domino=True)))
    head = drafter.head
    x, s = torch.randn(5, 64), torch.randn(5, 16)
    _, ref = head.prefix_gru(x[:, None], s[None])
    assert (head.gru(x, s) - ref[0]).abs().max() < 1e-6
    w1, w2 = head.embed_proj[0].weight, head.embed_proj[2].weight
    z = torch.randn(5, 64)
    naive = torch.nn.functional.silu(torch.cat((z, s), -1) @ w1.T) @ w2.T
    assert (head.delta(z, s) - naive).abs().max() < 1e-5


@torch.no_grad()
def test_split_attention_is_attention_over_the_joined_context():
    """The round's attention (no join, no repeated K/V head) against SDPA over the joined, repeated keys and values,
    GQA and an empty context included."""
    import torch.nn.functional as F

    from dtrt.models.drafter import split_attention

    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, ctx in ((4, 2, 9), (6, 3, 0), (2, 2, 33)):
        q = torch.randn(heads, 8, 16, generator=gen)
        ck, cv = (torch.randn(kv_heads, ctx, 16, generator=gen) for _ in range(2))
        k, v = (torch.randn(kv_heads, 8, 16, generator=gen) for _ in range(2))
        g = heads // kv_heads
        kk, vv = (torch.cat(t, 1).repeat_interleave(g, 0) for t in ((ck, k), (cv, v)))
        want = F.scaled_dot_product_attention(q[None], kk[None], vv[None])[0]
        torch.testing.assert_close(split_attention(q, ck, cv, k, v), want, rtol=1e-5, atol=1e-6)

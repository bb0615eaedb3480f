"""The target matches transformers' Qwen3ForCausalLM and LlamaForCausalLM on the same weights, including a tree
verify step against re-running every root-to-node path linearly, and the KV commit."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dtrt.models.checkpoint import load_target
from dtrt.models.target import KVCache
from dtrt.tree import Tree

ARCHS = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
    "llama": (LlamaForCausalLM, LlamaConfig, dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    cls, cfg_cls, kw = ARCHS[request.param]
    torch.manual_seed(1)
    cfg = cfg_cls(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e4,
        **kw,
    )
    hf = cls(cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_target(path)
    return hf, ours


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@torch.no_grad()
def test_prefill_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 100, (13,))
    ref = hf(ids[None], output_hidden_states=True)
    logits, taps = ours(ids, torch.arange(13), causal(13), KVCache(ours.cfg, 32), taps=(0, 1))
    assert (logits - ref.logits[0]).abs().max() < 1e-5
    # taps are decoder-layer outputs before the final norm: hidden_states[id + 1]
    assert (taps[:, :64] - ref.hidden_states[1][0]).abs().max() < 1e-5
    assert (taps[:, 64:] - ref.hidden_states[2][0]).abs().max() < 1e-5


@torch.no_grad()
def test_tree_verify_matches_linear_paths_and_commit(pair):
    hf, ours = pair
    prompt = torch.randint(0, 100, (9,))
    cache = KVCache(ours.cfg, 64)
    ours(prompt, torch.arange(9), causal(9), cache)
    cache.commit(torch.arange(9))
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 0, 7])
    tree = Tree.from_parents(torch.randint(0, 100, (10,)), parents)
    logits, _ = ours(tree.tokens, tree.positions(9), tree.mask, cache)
    for i in range(len(tree)):
        path = [j for j in range(len(tree)) if tree.mask[i, j]]
        ref = hf(torch.cat((prompt, tree.tokens[path]))[None]).logits[0, -1]
        assert (logits[i] - ref).abs().max() < 1e-5, i
    # commit root -> 1 -> 3 -> 6, then one decode step equals the linear run
    accepted = [0, 1, 3, 6]
    cache.commit(accepted)
    assert cache.past == 13
    nxt = torch.tensor([42])
    step, _ = ours(nxt, torch.tensor([13]), causal(1), cache)
    ref = hf(torch.cat((prompt, tree.tokens[accepted], nxt))[None]).logits[0, -1]
    assert (step[0] - ref).abs().max() < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads(pair, tmp_path, dtype):
    hf, ours = pair
    hf.save_pretrained(tmp_path)
    half = load_target(tmp_path, dtype)
    assert half.lm_head.weight.dtype == dtype
    ids = torch.randint(0, 100, (7,))
    ref, _ = ours(ids, torch.arange(7), causal(7))
    got, taps = half(ids, torch.arange(7), causal(7), taps=(0,))
    assert got.dtype == torch.float32 and taps.dtype == dtype
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_equals_rotate_half_bit_for_bit(dtype):
    """apply_rope's gather-and-signed-sin form is the rotate_half form, to the last bit, in every dtype."""
    from transformers.models.llama.modeling_llama import rotate_half

    from dtrt.models.layers import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    x = (torch.randn(2, 4, 9, 16) * 30).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(100, 109), 16, 1e4, dtype)
    want = x * cos.unsqueeze(-3) + rotate_half(x) * sin.unsqueeze(-3)
    assert torch.equal(apply_rope(x, cos, sin), want)

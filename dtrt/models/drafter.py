"""The DFlash block-diffusion drafter (z-lab layout), optionally carrying Domino's correction head.

Context: the target's tapped features of committed positions are projected once,
ctx = hidden_norm(fc(features)), and every layer turns ctx into K/V (k_norm + RoPE at the absolute
position). These K/V are all the draft cache ever holds.
Block: B positions from `start`: slot 0 = the committed root token, slots 1.. = mask token, embedded with
the target's table. Queries come from the block only and attend, with no mask, to all cached context and to
the whole block. Output = norm(x); the target's lm_head turns rows into base logits.
"""

import torch
from torch import nn

from dtrt.models.config import DrafterConfig
from dtrt.models.domino import DominoHead
from dtrt.models.kv_buffer import KVBuffer
from dtrt.models.layers import MLP, Projections, RMSNorm, attention, committed_attention, rope_cos_sin


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Projections(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, qk_norm=True
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None, length=None):
        h = self.input_layernorm(x)
        q = self.self_attn.q(h, cos, sin)
        k, v = self.self_attn.kv(h, cos, sin)
        if length is not None:  # the fixed-shape block: the cache's whole capacity, `length` of it committed
            whole = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device)
            a = committed_attention(q, ctx_k, ctx_v, length, k, v, whole)
        elif mask is None and q.dim() == 3:  # a round's block (and its exported stage)
            a = split_attention(q, ctx_k, ctx_v, k, v)
        else:
            a = attention(q, torch.cat((ctx_k, k), dim=-2), torch.cat((ctx_v, v), dim=-2), mask)
        x = x + self.self_attn.out(a)
        return x + self.mlp(self.post_attention_layernorm(x))


def split_attention(q, ctx_k, ctx_v, k, v):
    """The block's unmasked attention over the cached context and the block, q [H, B, hd], ctx_k/ctx_v [KVH, C, hd],
    k/v [KVH, B, hd] -> [H, B, hd], written so that the exported stage never copies the context: the query heads of a
    K/V head are rows of one product (no K/V head repeated), the context's and the block's scores are two products
    side by side (no join of the cache with the block's keys), and so are the values. Joined, repeated per query head
    and transposed, the context was copied several times a layer (SmolLM2's int8 block, 2 rows, one thread: 6.9 ->
    4.3 ms a call at a past of 2,048, 2.3 ms either way at 128)."""
    heads, rows, hd = q.shape
    kv_heads = ctx_k.shape[0]
    qg = (q * hd**-0.5).reshape(kv_heads, heads // kv_heads * rows, hd)
    scores = torch.cat((qg @ ctx_k.transpose(-1, -2), qg @ k.transpose(-1, -2)), dim=-1)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    c = ctx_k.shape[-2]
    out = p[..., :c] @ ctx_v + p[..., c:] @ v
    return out.reshape(heads, rows, hd)


def block_cache_inputs(num_layers: int) -> list[str]:
    """A block stage's context-cache inputs, K then V of each draft layer in turn: cache_k0, cache_v0, cache_k1, ...
    Each is one layer's [P, kv_heads, head_dim], position-major (dtrt.runtime.backends.kv.LayerKV)."""
    return [f"cache_{kv}{i}" for i in range(num_layers) for kv in "kv"]


class DraftCache(KVBuffer):
    """The drafter's context K/V of committed positions, batch 1 (KVBuffer in the drafter's shape)."""

    def __init__(self, cfg: DrafterConfig, capacity: int, dtype=torch.float32, device="cpu"):
        super().__init__(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype, device)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, head: DominoHead | None = None):
        super().__init__()
        self.cfg = cfg
        taps = len(cfg.target_layer_ids)
        self.fc = nn.Linear(taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = head

    @property
    def dtype(self):
        return self.fc.weight.dtype

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def context_kv(self, features, positions):
        """features [..., n, taps*H], positions [..., n] -> per layer (k, v) [..., kv_heads, n, head_dim]."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block(self, x, positions, ctx_kv, mask=None, length=None):
        """x [..., B, H] block embeddings, positions [..., B], ctx_kv from `context_kv` (or the cache)
        -> normed hidden rows [..., B, H]. `mask` [..., B, C+B]: in training (a plain round has none); `length`: the
        fixed-shape block over a whole cache's capacity, the first `length` (a device tensor) committed."""
        cos, sin = self._rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask, length)
        return self.norm(x)

    def proposal_rows(self, hidden):
        """The rows that predict draft depths 0..k_draft-1 (shift_label: rows 0..B-1; DFlash: rows 1..B-1)."""
        return hidden[..., self.cfg.first_row : self.cfg.first_row + self.cfg.k_draft, :]

"""The target LLM: a Qwen3 / Llama dense decoder that verifies a token tree in one forward.

forward(ids [N], positions [N], mask [N, N], cache) attends to the whole past in the cache plus the new
tokens allowed by `mask` (the tree's ancestor mask; causal for prefill), writes the new K/V after the
past, and returns fp32 logits [N, V] and the tapped hidden states [N, taps*H] (outputs of the decoder
layers in `taps`, given per call, before the final norm). The cache only advances on `cache.commit(accepted)`.
"""

import torch
from torch import nn

from dtrt.models.config import TargetConfig
from dtrt.models.layers import MLP, Embedding, Projections, RMSNorm, attention, rope_cos_sin


class KVCache:
    """Preallocated K/V for every layer, [layers, *batch, kv_heads, capacity, head_dim] each (batch () for
    decoding; a batch of rows for data generation)."""

    def __init__(self, cfg: TargetConfig, capacity: int, dtype=torch.float32, device="cpu", batch: tuple = ()):
        shape = (cfg.num_layers, *batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.past = 0

    def update(self, layer: int, k, v):
        """Write the new tokens' K/V after the past; return views over past + new."""
        end = self.past + k.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        self.k[layer, ..., self.past : end, :] = k
        self.v[layer, ..., self.past : end, :] = v
        return self.k[layer, ..., :end, :], self.v[layer, ..., :end, :]

    def past_mask(self, mask):
        """Which past keys the new tokens (mask [..., N, N]) see: all of them."""
        return mask.new_ones(*mask.shape[:-1], self.past)

    def commit(self, accepted):
        """Move the accepted new entries (indices into the last forward's tokens, ascending) right after the past."""
        accepted = torch.as_tensor(accepted, dtype=torch.long, device=self.k.device)
        n = accepted.numel()
        src = self.past + accepted
        self.k[..., self.past : self.past + n, :] = self.k[..., src, :]  # advanced indexing copies before writing
        self.v[..., self.past : self.past + n, :] = self.v[..., src, :]
        self.past += n

    def reset(self):
        self.past = 0


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Projections(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            cfg.qk_norm,
            cfg.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, mask, cache, layer_idx):
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)
        return self.finish(x, attention(q, k, v, mask))

    def qkv(self, x, cos, sin):
        """The layer before attention: the new tokens' q [H, N, hd] and k, v [KVH, N, hd], rotated."""
        h = self.input_layernorm(x)
        return self.self_attn.q(h, cos, sin), *self.self_attn.kv(h, cos, sin)

    def finish(self, x, a):
        """The layer after attention `a` [H, N, hd]: the output projection, the residuals and the MLP."""
        x = x + self.self_attn.out(a)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Target(nn.Module):
    def __init__(self, cfg: TargetConfig, decoder: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = decoder if decoder is not None else Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for one generation of at most `capacity` positions."""
        return KVCache(self.cfg, capacity, self.dtype, self.lm_head.weight.device)

    def forward(self, ids, positions, mask, cache: KVCache | None = None, taps: tuple[int, ...] = (), last: int = 0):
        """ids/positions [..., N], mask bool [..., N, N]; a cache prepends its past to the keys; `taps`: the decoder
        layers whose outputs come back as the hidden states (what the drafter reads); `last` > 0: logits of the last
        `last` positions only (a batched prefill needs one row, not N x vocab)."""
        x = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        if cache is not None:  # every new token sees the whole past
            mask = torch.cat((cache.past_mask(mask), mask), dim=-1)
        tapped = {}
        run = getattr(cache, "run_layer", None)  # a static cache runs its layers' static calls (static_kv)
        for i, layer in enumerate(self.model.layers):
            x = run(layer, x, cos, sin, mask, i) if run is not None else layer(x, cos, sin, mask, cache, i)
            if i in taps:
                tapped[i] = x
        logits = self.lm_head(self.model.norm(x[..., -last:, :] if last else x)).float()
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else x[..., :0]
        return logits, hidden

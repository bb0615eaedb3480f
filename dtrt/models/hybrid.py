"""A hybrid target: Qwen3-Next's Gated-DeltaNet layers interleaved with gated full-attention layers, verifying a
token tree in one forward (DESIGN.md section 2).

A Gated-DeltaNet layer carries a recurrent state [H, dk, dv] and a conv window (its last K-1 inputs) instead of
K/V. A tree cannot be verified as if it were one sequence: a rejected sibling's update would reach the nodes
after it. So every node starts from its parent's state and convolves over its own ancestors
(dtrt::TreeGatedDeltaNet, dtrt::TreeCausalConv1d), the state after every node is kept, and commit copies the
last accepted node's state and window. `HybridTarget.flatten_tree` is the negative control (tests and
benchmarks only): the recurrent layers read the nodes as one chain in array order, as a naive verifier would.

Numerics follow transformers' Qwen3NextForCausalLM: RMSNorm weights stored as offsets from one, an output gate
on attention, partial RoPE, L2-normalised q/k, fp32 recurrence, and the gated RMSNorm before out_proj.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from dtrt.errors import DtrtError
from dtrt.models.config import HybridConfig
from dtrt.models.layers import MLP, Embedding, apply_rope, attention, rope_cos_sin
from dtrt.models.target import KVCache, Target
from dtrt.ops import tree_causal_conv1d, tree_gated_delta_net
from dtrt.ops.tree_gated_delta_net import chunk_gated_delta_rule


def tree_parents(mask: torch.Tensor) -> torch.Tensor:
    """Each node's parent from its ancestor mask [N, N] (parents precede children): the nearest ancestor, -1 for
    none. A causal mask gives the chain i-1."""
    idx = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask & (idx < idx[:, None]), idx, -1).amax(-1)


def recurrent_parents(mask, flatten_tree: bool = False) -> torch.Tensor:
    """The parents the recurrent layers follow: the tree's, or (the negative control) the array order."""
    mask = torch.as_tensor(mask)
    if flatten_tree:
        return torch.arange(mask.shape[-1], device=mask.device) - 1
    return tree_parents(mask)


class RecurrentState:
    """Per Gated-DeltaNet layer, the committed recurrent state [layers, *batch, H, dk, dv] (fp32) and conv window
    [layers, *batch, C, K-1]: what a hybrid target carries between rounds. The torch target keeps one in its cache
    (HybridCache), the export backends one beside their K/V (the target stage takes and returns it); both take the
    last accepted node's entries at commit, the node axis just before a state's last three axes."""

    def __init__(
        self, layers: int, heads: int, dk: int, dv: int, conv_dim: int, kernel: int, dtype, device, batch: tuple = ()
    ):
        self.state = torch.zeros(layers, *batch, heads, dk, dv, device=device)
        self.conv = torch.zeros(layers, *batch, conv_dim, kernel - 1, dtype=dtype, device=device)

    @classmethod
    def of(cls, cfg: HybridConfig, dtype, device, batch: tuple = ()) -> "RecurrentState":
        n = len(cfg.recurrent_layers)
        heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return cls(n, heads, dk, dv, cfg.conv_dim, cfg.linear_conv_kernel_dim, dtype, device, batch)

    def take(self, layer: int | slice, states: torch.Tensor, windows: torch.Tensor, last: int):
        """Layer `layer`'s entries (a slice: those layers', states and windows then lead with them) of node `last`
        from every node's states [..., N, H, dk, dv] and windows [..., N, C, K-1]."""
        self.state[layer] = states[..., last, :, :, :]
        self.conv[layer] = windows[..., last, :, :]

    def reset(self):
        self.state.zero_()
        self.conv.zero_()


class HybridCache(KVCache):
    """K/V of the full-attention layers, plus the recurrent state (RecurrentState). A forward keeps every node's
    state and window; commit moves the accepted K/V and takes the last accepted node's state and window."""

    def __init__(self, cfg: HybridConfig, capacity: int, dtype=torch.float32, device="cpu", batch: tuple = ()):
        super().__init__(replace(cfg, num_layers=len(cfg.attention_layers)), capacity, dtype, device, batch)
        n = len(cfg.recurrent_layers)
        self.recurrent_state = RecurrentState.of(cfg, dtype, device, batch)
        self.state, self.conv = self.recurrent_state.state, self.recurrent_state.conv
        self.node_states: list = [None] * n
        self.node_windows: list = [None] * n

    def recurrent(self, layer: int):
        return self.state[layer], self.conv[layer]

    def keep(self, layer: int, states, windows):
        self.node_states[layer], self.node_windows[layer] = states, windows

    def commit(self, accepted):
        super().commit(accepted)
        last = int(accepted[-1])
        for i, (states, windows) in enumerate(zip(self.node_states, self.node_windows)):
            self.recurrent_state.take(i, states, windows, last)
        self.node_states = [None] * len(self.node_states)
        self.node_windows = [None] * len(self.node_windows)

    def reset(self):
        super().reset()
        self.recurrent_state.reset()


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: the weight is stored as an offset from one and applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """norm(x) * SiLU(z) over each value head, the norm weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: fused q/k/v/z and b/a projections grouped by key head, short causal
    conv + SiLU over q/k/v, the gated delta rule, a gated RMSNorm and out_proj."""

    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        self.index = index  # among the Gated-DeltaNet layers: the cache slot
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        conv_dim = cfg.conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.hk * self.dk + 2 * self.hv * self.dv, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        a_log = torch.empty(self.hv)  # on the meta device left as it is (Embedding's docstring says why)
        self.A_log = nn.Parameter(a_log if a_log.is_meta else a_log.uniform_(0.01, 16).log())  # transformers' init
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)

    def forward(self, x, parents, cache):
        lead, r = x.shape[:-1], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.hk, 2 * self.dk + 2 * r * self.dv))
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).unflatten(-1, (self.hk, 2 * r)).split([r, r], dim=-1)
        mixed = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)  # [..., N, C]
        beta = b.reshape(*lead, self.hv).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(*lead, self.hv).float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        # plain sequences with nothing to keep (training): a padded conv and the chunked rule
        sequences = cache is None and torch.equal(parents, torch.arange(-1, lead[-1] - 1, device=parents.device))
        if sequences:
            mixed = F.silu(
                F.conv1d(F.pad(mixed.transpose(-1, -2), (self.kernel - 1, 0)), weight[:, None], groups=weight.shape[0])
            ).transpose(-1, -2)
        else:
            if cache is not None:
                state0, conv0 = cache.recurrent(self.index)
            else:
                state0 = x.new_zeros(*lead[:-1], self.hv, self.dk, self.dv, dtype=torch.float32)
                conv0 = x.new_zeros(*lead[:-1], mixed.shape[-1], self.kernel - 1)
            mixed, windows = tree_causal_conv1d(mixed, parents, conv0, weight)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = (l2norm(t.unflatten(-1, (self.hk, self.dk)).float()).repeat_interleave(r, dim=-2) for t in (q, k))
        args = (q * self.dk**-0.5, k, v.unflatten(-1, (self.hv, self.dv)).float(), g, beta)
        if sequences:
            out = chunk_gated_delta_rule(*args)
        else:
            out, states = tree_gated_delta_net(*args, parents, state0)
            if cache is not None:
                cache.keep(self.index, states, windows)
        out = self.norm(out.to(x.dtype), z.reshape(*lead, self.hv, self.dv))
        return self.out_proj(out.flatten(-2))


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: q_proj also yields a per-head output gate, offset q/k norms, partial RoPE."""

    def __init__(self, cfg: HybridConfig, index: int):
        super().__init__()
        self.index = index  # among the full-attention layers: the K/V cache slot
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        q, gate = self.q_proj(x).unflatten(-1, (self.heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q).transpose(-3, -2), cos, sin)
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        k = partial_rope(k.transpose(-3, -2), cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(-3, -2)
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        o = attention(q, k, v, mask).transpose(-3, -2).flatten(-2)
        return self.o_proj(o * torch.sigmoid(gate.flatten(-2)))


def partial_rope(x, cos, sin):
    """RoPE on the first cos.shape[-1] dims of each head, the rest passed through."""
    d = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), dim=-1)


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, i: int):
        super().__init__()
        kind = cfg.layer_types[i]
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, cfg.layer_types[:i].count(kind))
        else:
            self.self_attn = GatedAttention(cfg, cfg.layer_types[:i].count(kind))
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, parents, cache):
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, parents, cache)
        else:
            x = x + self.self_attn(h, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoder(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridTarget(Target):
    """Target's interface (forward, new_cache); forward also takes the tree's `parents` (default: read
    from the mask, which must be [N, N]: one tree for every row of a batch)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__(cfg, HybridDecoder(cfg))
        self.flatten_tree = False  # the negative control

    def new_cache(self, capacity: int) -> HybridCache:
        return HybridCache(self.cfg, capacity, self.dtype, self.lm_head.weight.device)

    def forward(self, ids, positions, mask, cache: HybridCache | None = None, parents=None, taps=()):
        if mask.dim() != 2:
            raise DtrtError(
                "a hybrid target takes one [N, N] mask for the whole batch; per-row masks (left-padded "
                "batches) are not supported for Gated-DeltaNet layers"
            )
        if cache is not None and not hasattr(cache, "recurrent"):
            raise DtrtError("a hybrid target needs a cache with recurrent state: use HybridTarget.new_cache")
        if parents is None:
            parents = recurrent_parents(mask, self.flatten_tree)
        x = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        if cache is not None:
            mask = torch.cat((cache.past_mask(mask), mask), dim=-1)
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, parents, cache)
            if i in taps:
                tapped[i] = x
        logits = self.lm_head(self.model.norm(x)).float()
        hidden = torch.cat([tapped[i] for i in taps], dim=-1) if taps else x[..., :0]
        return logits, hidden

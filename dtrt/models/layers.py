"""Building blocks shared by the target and the drafter (Qwen3 / Llama numerics, as in transformers)."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dtrt.ops import tree_attention
from dtrt.ops.kernels import kernel


class Embedding(nn.Embedding):
    """nn.Embedding that leaves a meta tensor uninitialized: a checkpoint's tensor replaces it, and normal_ on the
    meta device runs torch._refs, whose first call imports torch._dynamo (about a second of loading a target)."""

    def reset_parameters(self):
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    return torch.tensor(
        [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)], dtype=torch.float32, device=device
    )


_cached_inv_freq = functools.lru_cache(maxsize=16)(_inv_freq)


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """cos/sin [..., head_dim] for integer positions, in fp32 like transformers. The inverse frequencies are a
    constant (computed in float64, rounded once), so an exported graph rotates by exactly the same angles.
    Eagerly they are made once per device: a copy from the host on every call could not be captured in a
    CUDA graph."""
    make = _inv_freq if torch.onnx.is_in_onnx_export() else _cached_inv_freq
    inv_freq = make(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _half_turn(hd: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the index that swaps the two halves of a head, the sign in `dtype` that negates the new first half)."""
    half = hd // 2
    order = torch.cat((torch.arange(half, hd), torch.arange(half))).to(device)
    sign = torch.cat((-torch.ones(half), torch.ones(half))).to(device=device, dtype=dtype)
    return order, sign


_cached_half_turn = functools.lru_cache(maxsize=16)(_half_turn)


def apply_rope(x, cos, sin):
    """x [..., heads, n, hd]; cos/sin [..., n, hd] broadcast over heads. rotate_half(x) * sin written as a gather
    of x times a signed sin: (-a) * s and a * (-s) are the same float, so this is bit for bit the usual form, and
    an exported layer runs one Gather where cat(-x2, x1) took a Split, a Neg and a Concat (the signed sin is the
    same product in every layer, which ONNX Runtime computes once)."""
    make = _half_turn if torch.onnx.is_in_onnx_export() else _cached_half_turn
    order, sign = make(x.shape[-1], x.device, sin.dtype)
    return x * cos.unsqueeze(-3) + x.index_select(-1, order) * (sin * sign).unsqueeze(-3)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Projections(nn.Module):
    """q/k/v/o projections with optional per-head q_norm/k_norm; attention itself is done by the caller."""

    def __init__(self, hidden, heads, kv_heads, head_dim, eps, qk_norm: bool, bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x, n_heads):  # [..., n, n_heads*hd] -> [..., n_heads, n, hd]
        return x.unflatten(-1, (n_heads, self.head_dim)).transpose(-3, -2)

    def q(self, x, cos, sin):
        q = self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(-3, -2), cos, sin)

    def kv(self, x, cos, sin):
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(-3, -2), cos, sin)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def out(self, o):  # o [..., heads, n, hd]
        return self.o_proj(o.transpose(-3, -2).flatten(-2))


def attention(q, k, v, mask=None):
    """q [..., H, n, hd], k/v [..., KVH, m, hd] (GQA), mask bool [..., n, m] (True = attend): dtrt::TreeAttention."""
    return tree_attention(q, k, v, mask)


def committed(q, past_k, past_v, length, new_k, new_v, tree):
    """Attention of N new tokens over a fixed-capacity past and themselves: q [H, N, hd], past_k/past_v [KVH, C, hd]
    of which the first `length` columns (a device scalar) are committed and seen by every row, new_k/new_v
    [KVH, N, hd] seen under `tree` [N, N]. The shapes never depend on the length (what a CUDA graph needs). On CUDA
    the split kernel (dtrt.plugins.static_tree_attention) reads only the committed columns; elsewhere, the
    reference over the joined keys under the joined mask. Returns a contiguous [H, N, hd]."""
    if (run := kernel("static_tree_attention", q, past_k, past_v, new_k, new_v)) is not None:
        return run(q, past_k, past_v, length, new_k, new_v, tree)
    c = past_k.shape[-2]
    seen = (torch.arange(c, device=q.device) < length).expand(tree.shape[0], c)
    keys, values = torch.cat((past_k, new_k), dim=-2), torch.cat((past_v, new_v), dim=-2)
    return tree_attention(q, keys, values, torch.cat((seen, tree), dim=-1)).contiguous()


@torch.library.custom_op("dtrt::committed_attention", mutates_args=())
def committed_attention(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    length: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    tree: torch.Tensor,
) -> torch.Tensor:
    """`committed` as a custom op (the fixed-shape draft block's attention): torch.compile keeps it whole."""
    return committed(q, past_k, past_v, length, new_k, new_v, tree)


@committed_attention.register_fake
def _(q, past_k, past_v, length, new_k, new_v, tree):
    return q.new_empty(q.shape)  # contiguous, as both implementations return it

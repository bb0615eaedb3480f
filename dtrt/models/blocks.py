"""Block-quantized weights as a quantized file holds them, and the PyTorch reference of their product.

    W[o, b*block + j] = scale[o, b] * (q[o, b*block + j] - zero) + min[o, b]

`q` are the file's integer codes (uint8, or int8 where the file stores signed codes), `zero` one integer for the
whole format, `scale` and `min` fp32 per block of `block` input features (`min` None where the format has none).
`dequantize` evaluates this in the order the `gguf` package does, so a weight read from a GGUF file gives back that
package's dequantization bit for bit (dtrt.models.gguf_blocks).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockWeight:
    kind: str
    """The format's name (a GGUF tensor type: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)."""
    q: torch.Tensor
    """[..., K] integer codes: uint8, or int8 for a format with signed codes (Q8_0)."""
    scale: torch.Tensor
    """[..., K / block] fp32."""
    min: torch.Tensor | None
    """[..., K / block] fp32, added after the scaled codes; None where the format has no mins."""
    zero: int
    """Subtracted from every code before scaling (Q4_0: 8, Q6_K: 32, otherwise 0)."""
    block: int
    """Input features per scale: 32, or 16 (Q6_K)."""

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def blocked(self, t: torch.Tensor) -> torch.Tensor:
        """t [..., K] as [..., K / block, block]."""
        return t.reshape(*t.shape[:-1], t.shape[-1] // self.block, self.block)


def scaled_codes(w: BlockWeight) -> torch.Tensor:
    """scale * (q - zero), fp32 [..., K]: the weights without their mins."""
    q = w.q.to(torch.float32)
    if w.zero:
        q = q - w.zero  # small integers: exact
    return (w.scale[..., None] * w.blocked(q)).reshape(w.q.shape)


def dequantize(w: BlockWeight | torch.Tensor) -> torch.Tensor:
    """The fp32 weights [..., K]; a float tensor (a file's F32/F16/BF16 tensor) is returned as fp32."""
    if isinstance(w, torch.Tensor):
        return w.to(torch.float32)
    out = scaled_codes(w)
    if w.min is None:
        return out
    return (w.blocked(out) + w.min[..., None]).reshape(w.q.shape)


@torch.no_grad()
def block_matmul(*, x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """y = x · (scale∘(q - zero))ᵀ + blocksum(x) · minᵀ for fp32 x [..., K] and a 2-D w [N, K]: x @ dequantize(w)ᵀ
    up to fp32 rounding. Each row is computed alone, on a fresh copy, so its bits do not depend on how many rows
    come with it (the BLAS kernels that a product of several rows takes sum in another order than one row's)."""
    if x.dtype != torch.float32 or w.q.dim() != 2 or x.shape[-1] != w.q.shape[1]:
        got = f"{x.dtype} x {tuple(x.shape)}, weight {tuple(w.q.shape)}"
        raise ValueError(f"block_matmul takes fp32 x [..., K] and a 2-D weight [N, K]; got {got}")
    codes = scaled_codes(w)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], codes.shape[0], dtype=torch.float32)
    for i in range(rows.shape[0]):
        row = rows[i].clone()
        y = torch.mv(codes, row)
        if w.min is not None:
            y = y + torch.mv(w.min, w.blocked(row).sum(-1))
        out[i] = y
    return out.reshape(*x.shape[:-1], codes.shape[0])

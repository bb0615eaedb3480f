"""Block-quantized weights as a quantized file holds them, and the PyTorch reference of their product.

    W[o, b*block + j] = scale[o, b] * (q[o, b*block + j] - zero) + min[o, b]

`q` are the file's integer codes (uint8, or int8 where the file stores signed codes), `zero` one integer for the
whole format, `scale` and `min` fp32 per block of `block` input features (`min` None where the format has none).
`dequantize` evaluates this in the order the `gguf` package does, so a weight read from a GGUF file gives back that
package's dequantization bit for bit (dtrt.models.gguf_blocks). `pack_blocks` lays a weight out as dtrt's
`BlockMatMul` / `BlockMatMulMin` ops take it (4-bit codes two a byte, the others a byte each), `unpack_blocks`
reads it back exactly.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BlockWeight:
    kind: str
    """The format's name (a GGUF tensor type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)."""
    q: torch.Tensor
    """[..., K] integer codes: uint8, or int8 for a format with signed codes (Q8_0)."""
    scale: torch.Tensor
    """[..., K / block] fp32."""
    min: torch.Tensor | None
    """[..., K / block] fp32, added after the scaled codes; None where the format has no mins."""
    zero: int
    """Subtracted from every code before scaling (Q3_K: 4, Q4_0: 8, Q5_0: 16, Q6_K: 32, otherwise 0)."""
    block: int
    """Input features per scale: 32, or 16 (Q2_K, Q3_K, Q6_K)."""

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


# formats whose codes fit in 4 bits: two a byte; the others keep a byte a code (Q8_0's int8 codes shifted by 128)
FOUR_BITS = ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K")
EIGHT_BITS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


@dataclass(frozen=True)
class PackedBlocks:
    """A BlockWeight as dtrt's `BlockMatMul` / `BlockMatMulMin` ops take it (dtrt.ops.functions.block_matmul)."""

    q: np.ndarray
    """uint8: bits 4, [N, K/2], each block's codes i and i + block/2 in the low and high nibble of its byte i
    (GGUF's Q4_0 layout); bits 8, [N, K], a code a byte."""
    scale: np.ndarray
    """fp32 [N, K / block]."""
    min: np.ndarray | None
    """fp32 [N, K / block], or None (op `BlockMatMul`)."""
    bits: int
    block: int
    zero: int
    """0..255, subtracted from every code."""
    op: str
    """`BlockMatMul`, or `BlockMatMulMin` where there are mins."""
    kind: str = ""
    """The format packed (BlockWeight.kind), for unpack_blocks."""


def codes_uint8(w: BlockWeight) -> tuple[np.ndarray, int]:
    """(codes uint8 [N, K], zero point) of a 2-D weight: a signed format's codes offset by 128 (exact)."""
    q = w.q.numpy()
    if q.dtype == np.int8:
        return (q.astype(np.int16) + 128).astype(np.uint8), w.zero + 128
    return q, w.zero


def block_layout(w: BlockWeight) -> tuple[str, int, int, int]:
    """(op, bits, block, zero) of pack_blocks(w), without packing it: what products merged into one must share."""
    zero = w.zero + 128 if w.q.dtype == torch.int8 else w.zero
    return ("BlockMatMul" if w.min is None else "BlockMatMulMin"), (4 if w.kind in FOUR_BITS else 8), w.block, zero


def pack_blocks(w: BlockWeight) -> PackedBlocks:
    """A 2-D BlockWeight [N, K] as the ops' inputs and attributes: Q4_0, Q4_1, Q2_K, Q3_K, Q4_K's codes two a byte
    (bits 4); Q5_0's, Q5_1's, Q5_K's and Q6_K's a byte each as they are, Q8_0's signed codes plus 128 with zero 128
    (bits 8). Exact:
    unpack_blocks gives back a BlockWeight whose dequantize() is w's bit for bit."""
    if w.q.dim() != 2 or w.kind not in FOUR_BITS + EIGHT_BITS:
        raise ValueError(
            f"pack_blocks takes a 2-D {'/'.join(FOUR_BITS + EIGHT_BITS)} weight; got {w.kind} {tuple(w.shape)}"
        )
    q, zero = codes_uint8(w)
    n, k = q.shape
    if q.dtype != np.uint8 or not 0 <= zero <= 255 or k % w.block:
        raise ValueError(f"pack_blocks: {w.kind} codes {q.dtype} with zero {w.zero} and block {w.block} over {k}")
    op, bits, _, _ = block_layout(w)
    if bits == 4:
        if q.size and int(q.max()) > 15:
            raise ValueError(f"pack_blocks: a {w.kind} code above 15")
        halves = q.reshape(n, k // w.block, 2, w.block // 2)
        q = (halves[:, :, 0] | (halves[:, :, 1] << np.uint8(4))).reshape(n, k // 2)
    return PackedBlocks(
        q=np.ascontiguousarray(q),
        scale=np.ascontiguousarray(w.scale.numpy(), dtype=np.float32),
        min=None if w.min is None else np.ascontiguousarray(w.min.numpy(), dtype=np.float32),
        bits=bits,
        block=w.block,
        zero=zero,
        op=op,
        kind=w.kind,
    )


def unpack_blocks(p: PackedBlocks) -> BlockWeight:
    """The BlockWeight that pack_blocks packed (Q8_0's int8 codes and zero 0 where p.kind says Q8_0)."""
    q = p.q
    if p.bits == 4:
        n = q.shape[0]
        halves = q.reshape(n, -1, 1, p.block // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (halves & np.uint8(0x0F)).reshape(n, -1)
    zero = p.zero
    if p.kind == "Q8_0" and zero == 128:
        q, zero = (q.astype(np.int16) - 128).astype(np.int8), 0
    return BlockWeight(
        kind=p.kind or f"packed{p.bits}",
        q=torch.from_numpy(np.array(q)),  # a copy: the packed codes may be read-only (an initializer's)
        scale=torch.from_numpy(np.array(p.scale, dtype=np.float32)),
        min=None if p.min is None else torch.from_numpy(np.array(p.min, dtype=np.float32)),
        zero=zero,
        block=p.block,
    )

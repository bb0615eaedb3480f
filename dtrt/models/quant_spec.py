"""The target quantizations by name, as values: `--quant` and its block and method (QuantSpec, GgufQuant) and a
manifest's `quant` entry. No torch here, so that the flags built from them cost no import of it; the quantization
itself (quantize, dequantize) is dtrt.models.quant."""

from dataclasses import dataclass
from typing import Literal

QUANTS = ("none", "int8", "int4", "gguf", "gguf-a8")
INT4_BLOCKS = (32, 64, 128)
METHODS = ("rtn", "mse")


@dataclass(frozen=True)
class QuantSpec:
    """How a target's weights are quantized (the export manifest's `quant` entry)."""

    bits: Literal[4, 8]
    """8: int8 per output channel; 4: int4 per block of `block` input features."""
    block: int | None = None
    """int4's block size along the input features (a last, shorter block where it does not divide them)."""
    method: Literal["rtn", "mse"] = "rtn"
    """rtn: scale = absmax / qmax; mse: the clip ratio of absmax with the least squared reconstruction error."""

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_json(self) -> dict:
        return {"bits": self.bits, "block": self.block, "method": self.method}

    @classmethod
    def from_json(cls, d: dict) -> "QuantSpec":
        return cls(bits=int(d["bits"]), block=d.get("block"), method=d.get("method", "rtn"))


@dataclass(frozen=True)
class GgufQuant:
    """A target whose linear layers keep the 4- or 8-bit blocks of the GGUF file it was converted from, as that file
    holds them (dtrt.exporter.gguf_target): the file's own quantization, not a second one. Its weights are the
    checkpoint's, bit for bit (the checkpoint is the file dequantized), so its PyTorch reference is the checkpoint's
    fp32 target itself."""

    activations: Literal["fp32", "int8"]
    """fp32: dtrt's BlockMatMul kernel, fp32 activations and sums (`--quant gguf`); int8: ONNX Runtime's MatMulNBits
    at accuracy level 4, activations quantized per block as llama.cpp does (`--quant gguf-a8`)."""
    bits = None  # a QuantSpec's fields, for code that asks any target quantization
    block = None
    method = "gguf"

    @property
    def name(self) -> str:
        return "gguf" if self.activations == "fp32" else "gguf-a8"

    def to_json(self) -> dict:
        return {"format": "gguf", "activations": self.activations}


def quant_from_json(d: dict) -> "QuantSpec | GgufQuant":
    """A manifest's `quant` entry as its spec."""
    if d.get("format") == "gguf":
        return GgufQuant(activations=d["activations"])
    return QuantSpec.from_json(d)


def quant_spec(quant: str, block: int = 32, method: str = "rtn") -> "QuantSpec | GgufQuant | None":
    """`--quant` (with `--quant-block`, `--quant-method`) as a QuantSpec or GgufQuant; None for "none". ValueError
    on a bad one."""
    if quant not in QUANTS:
        raise ValueError(f"use one of {', '.join(QUANTS)}")
    if method not in METHODS:
        raise ValueError(f"--quant-method {method!r}: use one of {', '.join(METHODS)}")
    if quant == "none":
        return None
    if quant in ("gguf", "gguf-a8"):
        return GgufQuant(activations="fp32" if quant == "gguf" else "int8")
    if quant == "int8":
        return QuantSpec(bits=8, method=method)
    if block not in INT4_BLOCKS:
        raise ValueError(f"--quant-block {block}: use one of {', '.join(map(str, INT4_BLOCKS))}")
    return QuantSpec(bits=4, block=block, method=method)

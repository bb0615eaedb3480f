"""ExportConfig: what `dtrt export` makes of a pair, as one frozen object whose values are checked once, here. The
command's flags are generated from its fields (dtrt.cli.options), so each one's type, choices, default and help are
written here only."""

from dataclasses import dataclass
from typing import Literal

from dtrt.errors import DtrtError
from dtrt.models.quant_spec import METHODS as QUANT_METHODS
from dtrt.models.quant_spec import QUANTS, QuantSpec, quant_spec
from dtrt.runtime.spec import RunSpec

DRAFTER_KINDS = ("dflash", "domino")
EXPORT_DTYPES = ("fp32", "fp16", "bf16")  # bf16: for TensorRT (ONNX Runtime's CPU provider has no bf16 kernels)
DRAFTER_QUANTS = ("none", "int8", "int4")  # the drafter stages' weights (dtrt.exporter.quantize)


def check_drafter_quant(quant: str, dtype: str):
    if quant not in DRAFTER_QUANTS:
        raise DtrtError(f"--drafter-quant {quant!r}: use one of {', '.join(DRAFTER_QUANTS)}")
    if quant != "none" and dtype != "fp32":
        raise DtrtError(f"--drafter-quant {quant} quantizes fp32 weights; use it with --dtype fp32")


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    dtype: Literal[EXPORT_DTYPES] = "fp32"
    """The stages' precision (bf16: for TensorRT; ONNX Runtime's CPU provider has no bf16 kernels)."""
    max_context: int = 4096
    """Largest past + new tokens the stages take."""
    budget: int = RunSpec.budget
    """Tree budget of the fixed-shape stages (frontier, chain)."""
    topm: int = RunSpec.topm
    """Domino candidates per depth of the scorer and frontier stages, M (0: the whole vocabulary)."""
    node_topk: int = RunSpec.node_topk
    """Children per tree node of the frontier stage, k."""
    drafter_quant: Literal[DRAFTER_QUANTS] = "none"
    """Quantized drafter weights (ONNX Runtime CPU; drafts only, output unchanged): the context stages in int4 and the
    block stages' draft layers in int8, their lm_head in int8 or int4 (dtrt.exporter.quantize)."""
    drafters: tuple[str, ...] | None = None
    """The drafter kinds to export, dflash and/or domino (default: every one the pair has; a Domino drafter alone
    serves every method, its body being a DFlash drafter)."""
    quant: Literal[QUANTS] = "none"
    """The target's linear layers, lm_head included, as weight-only int8 (per output channel) or int4 (per block of
    --quant-block input features), or as the blocks of the GGUF file the target was converted from (gguf: fp32
    activations in dtrt's kernel; gguf-a8: int8 activations, as llama.cpp); the quantized model is the target every
    method reproduces."""
    quant_block: int = 32
    """int4: input features per scale (32, 64 or 128)."""
    quant_method: Literal[QUANT_METHODS] = "rtn"
    """rtn: scale = absmax / qmax; mse: the clip of absmax with the least squared error per channel or block."""
    draft_vocab: str | None = None
    """The drafters' base logits over a reduced vocabulary: `full`, or a subset file (`dtrt draft-vocab` writes
    one); default (or `auto`): each drafter's own d2t.safetensors where it has one, else full."""
    jobs: int = 1
    """Processes that export side by side: 2 exports the target stage in a second process while this one exports the
    drafter stages (the same files; SmolLM2's gguf export took 27-30 s against 37 s on a 2-core VM; the second
    process loads its own copy of the target)."""
    force: bool = False
    """Replace an existing export directory."""

    def __post_init__(self):
        if self.dtype not in EXPORT_DTYPES:
            raise DtrtError(f"--dtype {self.dtype}: export supports {', '.join(EXPORT_DTYPES)}")
        check_drafter_quant(self.drafter_quant, self.dtype)
        if self.max_context < 2 or self.budget < 1:
            raise DtrtError("--max-context must be >= 2 and --budget >= 1")
        if self.jobs not in (1, 2):
            raise DtrtError(f"--jobs {self.jobs}: use 1 or 2")
        for kind in self.drafters or ():
            if kind not in DRAFTER_KINDS:
                raise DtrtError(f"--drafters {kind!r}: use some of {', '.join(DRAFTER_KINDS)}")
        self.quant_spec  # noqa: B018 (checks --quant, --quant-block, --quant-method)

    @property
    def quant_spec(self) -> QuantSpec | None:
        """--quant with --quant-block and --quant-method (None: not quantized)."""
        try:
            return quant_spec(self.quant, self.quant_block, self.quant_method)
        except ValueError as e:
            msg = str(e)
            raise DtrtError(msg if msg.startswith("--") else f"--quant {self.quant!r}: {msg}") from None

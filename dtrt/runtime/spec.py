"""RunSpec: everything that decides one pipeline (model sources, backend, method and its tree), as one frozen
object. Front ends resolve it once from their inputs (dtrt.launch applies the defaults); its values are checked
here, once; dtrt.runtime.pipeline.open_pipeline turns it into a pipeline. Per-request settings (max tokens,
sampling, stop strings, the chat template's thinking switch) are a Request (dtrt.frontend.requests)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from dtrt.errors import DtrtError
from dtrt.models import quant_spec

# The method registry's names (dtrt.runtime.methods.METHODS, whose classes hold the traits), written out here so that
# the flags built from this class need no torch: `dtrt --help` answers in about 0.15 s. A test keeps the two
# lists equal.
MethodName = Literal["ar", "lookup", "dflash", "domino", "ddtree", "caddtree", "dominotree", "cadominotree"]
Builder = Literal["heap", "frontier"]
Arm = Literal["dominotree", "condstatic", "marg"]
BackendName = Literal["torch", "onnxruntime", "tensorrt"]
DType = Literal["fp32", "bf16", "fp16"]
Quant = Literal[quant_spec.QUANTS]  # the target quantizations by name, one list

METHODS: tuple[str, ...] = get_args(MethodName)
BUILDERS: tuple[str, ...] = get_args(Builder)
ARMS: tuple[str, ...] = get_args(Arm)
BACKENDS: tuple[str, ...] = get_args(BackendName)
DTYPES: tuple[str, ...] = get_args(DType)
QUANTS: tuple[str, ...] = get_args(Quant)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    model: str | None = None
    """Registry name of the pair (`--model`); None when checkpoints (`--target`) or an export alone are named."""
    target: Path | None = None
    """Target checkpoint directory in the Hugging Face layout (`--target`)."""
    drafter: Path | None = None
    """Drafter checkpoint directory, DFlash or Domino layout (`--drafter`)."""
    model_dir: Path | None = None
    """Where registry checkpoints are looked up before the Hugging Face cache (`--model-dir`)."""
    export: Path | None = None
    """`dtrt export` directory: what onnxruntime runs (`--export`)."""
    engines: Path | None = None
    """`dtrt build-engine` directory, or the `--out` root it was given: what tensorrt runs (`--engines`)."""
    backend: BackendName = "torch"
    """What runs the stages: the PyTorch reference, ONNX Runtime over an export, TensorRT over engines."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`: where the torch backend's models or ONNX Runtime's CUDA provider run."""
    dtype: DType | None = None
    """Torch backend: the weights' precision (None: fp32). Export backends: must equal the export's (None: it)."""
    quant: Quant | None = None
    """The target's weight-only quantization (`--quant`): which first-use export a registry model runs from on
    ONNX Runtime (int8, int4: quantized by dtrt; gguf, gguf-a8: its GGUF file's own blocks, at fp32 or int8
    activations); the torch backend multiplies by the same dequantized weights; an --export or engine carries its
    own, which this must equal (None: the export's, or full precision)."""
    threads: int | None = None
    """Intra-op threads of the models (None: the library's own count): torch's on the torch backend, ONNX Runtime's
    on onnxruntime, where torch runs only the host's small ops, on one thread."""
    method: MethodName = "dominotree"
    """How a round's drafter output becomes a tree (docs/methods.md)."""
    budget: int = 16
    """Draft nodes per tree, the verify width minus one (caddtree, cadominotree: the cap; lookup: the chain's
    length)."""
    builder: Builder = "heap"
    """DominoTree's builder: the sequential best-first heap, or the fixed-shape frontier."""
    arm: Arm = "dominotree"
    """DominoTree's scoring: per realized path, once per depth on the greedy chain, or no correction."""
    topm: int = 64
    """Domino candidates per depth of the tree builders, M (0: the whole vocabulary); the domino chain always
    takes the whole vocabulary, as Domino does."""
    node_topk: int = 8
    """Children per tree node, k."""
    cuda_graph: bool = False
    """DominoTree with the frontier on a CUDA torch backend: drafting and building replayed as one CUDA graph."""
    static_shapes: bool = False
    """Torch backend, a dense target: the target's K/V in one buffer for the context limit and every verify at a
    fixed width (1, 2, 4, ..., 64; the tree padded with dead leaves), its mask, accept walk, commit and the drafter's
    context on the device at T=0; on CUDA each width's round is one CUDA graph. Off by default: a padded call rounds
    differently from the plain one, which can turn a near-tie."""
    compile: bool = True
    """With --static-shapes on CUDA: each decoder layer's parts before and after attention run compiled by
    torch.compile (Inductor fuses their norms, rotations and activations around the matrix products), one compile
    for every layer and every width but 1, inside the rounds' CUDA graphs; the cache writes and the attention stay
    outside the compiled code. The first round waits for the compile (Inductor keeps it on disk for later
    processes). --no-compile captures the eager ops as they are."""
    draft_vocab: str | None = None
    """The vocabulary the drafter's base logits cover (`--draft-vocab`): None, the drafter's own d2t.safetensors
    where it has one (an export: the subset it was exported with; a model's first-use export: the registry's subset
    for its target, dtrt.zoo.registry.default_draft_vocab), else the whole vocabulary; `full`, the whole
    vocabulary; a path, that subset file (`dtrt draft-vocab` writes one). Tokens outside it are never drafted; the
    target still verifies over its whole vocabulary, so the output is unchanged."""
    lookup: bool = False
    """DominoTree's heap builder also takes prompt lookup's chains (`--lookup`): one tree, one budget, each lookup
    node scored by its parent's path probability times the request's measured acceptance of lookup nodes."""
    prefix_cache_mb: int | None = None
    """MiB of prefix snapshots kept across requests (`--prefix-cache-mb`, least recently used first): a prompt that
    begins with tokens a snapshot holds restores them instead of prefilling them. None: 1024 where the backend can
    snapshot its state (a dense target), else off; 0: off (`--no-prefix-cache`)."""

    def __post_init__(self):
        for flag, value, allowed in (
            ("--method", self.method, METHODS),
            ("--builder", self.builder, BUILDERS),
            ("--arm", self.arm, ARMS),
            ("--backend", self.backend, BACKENDS),
        ):
            if value not in allowed:
                raise DtrtError(f"{flag} {value!r}: use one of {', '.join(allowed)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise DtrtError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.quant is not None and self.quant not in QUANTS:
            raise DtrtError(f"--quant {self.quant!r}: use one of {', '.join(QUANTS)}")
        for flag, value, low in (
            ("--budget", self.budget, 1),
            ("--node-topk", self.node_topk, 1),
            ("--topm", self.topm, 0),
        ):
            if value < low:
                raise DtrtError(f"{flag} {value}: must be >= {low}")
        if self.threads is not None and self.threads < 1:
            raise DtrtError(f"--threads {self.threads}: must be >= 1")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise DtrtError(f"--prefix-cache-mb {self.prefix_cache_mb}: must be >= 0 (0, or --no-prefix-cache: off)")
        from dtrt.runtime.methods import METHODS as REGISTRY  # the classes' traits: imported once a spec is made
        from dtrt.runtime.methods import method_class

        cls = method_class(self.method)
        if self.lookup and not cls.takes_lookup:
            takers = " or ".join(n for n, m in REGISTRY.items() if m.takes_lookup)
            raise DtrtError(
                f"--lookup: adds lookup nodes to DominoTree's tree, not to --method {self.method}; use --method "
                f"{takers} (or --method lookup, lookup alone)"
            )
        if self.lookup and self.cuda_graph:
            raise DtrtError("--lookup: the heap builder takes lookup nodes, --cuda-graph does not; drop --cuda-graph")
        if self.lookup and self.builder != "heap":
            raise DtrtError(
                f"--lookup: the heap builder takes lookup nodes, --builder {self.builder} does not; use --builder heap"
            )
        if cls.builders and self.builder not in cls.builders:
            raise DtrtError(
                f"--builder {self.builder}: {self.method} decides per node whether to grow the tree, which the host "
                f"heap builder does; use --builder {' or '.join(cls.builders)} (or --method dominotree)"
            )
        if self.cuda_graph and (not cls.cuda_graph or self.builder != "frontier"):
            given = f"--method {self.method}" if not cls.cuda_graph else f"--builder {self.builder}"
            raise DtrtError(
                f"--cuda-graph: captures DominoTree's fixed-shape frontier build, not {given}; use "
                f"--method dominotree --builder frontier"
            )
        kind = device_kind(self.device)
        if self.cuda_graph and (self.backend != "torch" or kind != "cuda"):
            raise DtrtError(
                "--cuda-graph: captures the torch backend's drafting on a GPU; add --device cuda"
                + (" and --backend torch" if self.backend != "torch" else "")
            )
        if self.static_shapes and self.backend != "torch":
            raise DtrtError(
                f"--static-shapes: the torch backend's verify at fixed widths, not --backend {self.backend}'s"
            )
        if kind == "cuda" and self.backend == "tensorrt":
            raise DtrtError(
                f"--device {self.device}: only the torch and onnxruntime backends take a device (--backend tensorrt "
                f"runs its engines on the GPU by itself)"
            )
        if self.export is not None and self.backend == "torch":
            raise DtrtError("--export DIR is for --backend onnxruntime; the torch backend runs checkpoints")
        if self.export is not None and self.backend == "tensorrt":
            raise DtrtError("--export DIR: --backend tensorrt runs engines; pass their directory as --engines DIR")
        if self.engines is not None and self.backend != "tensorrt":
            raise DtrtError(f"--engines DIR is for --backend tensorrt, not --backend {self.backend}")
        if self.model is not None and self.target is not None:
            raise DtrtError("--model and --target exclude each other: pass one")
        if self.drafter is not None and self.target is None:
            raise DtrtError("--drafter needs --target DIR (a --model name brings its own drafters)")

    @property
    def method_class(self):
        """The method's registry class: its traits (dtrt.runtime.methods)."""
        from dtrt.runtime.methods import method_class

        return method_class(self.method)

    @property
    def needs_head(self) -> bool:
        """Whether the method scores with Domino's correction head."""
        return self.method_class.needs_head(self)

    @property
    def uses_drafter(self) -> bool:
        return self.method_class.uses_drafter

    @property
    def label(self) -> str:
        """The method (+lookup under --lookup) with its budget where the budget sizes its trees (bench rows, logs)."""
        name = f"{self.method}+lookup" if self.lookup else self.method
        return f"{name}@{self.budget}" if self.method_class.has_budget else name


def device_kind(device: str) -> str:
    """'cpu' or 'cuda' for a --device value; a one-line error for anything else."""
    if device == "cpu":
        return "cpu"
    head, _, index = device.partition(":")
    if head == "cuda" and (not index or index.isdigit()):
        return "cuda"
    raise DtrtError(f"--device {device!r}: use cpu, cuda or cuda:N")

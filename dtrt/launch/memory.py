"""Will it fit: what the first-use ONNX Runtime export of a registry model needs in memory, against what this
machine has, checked before the export starts (an export that cannot fit would run for minutes, then fail).

Measured factors (resident memory over the bytes of weights):
- `dtrt export` peaks at about 2.4x the weights it writes, plus the runtime (Qwen3-4B fp16: 19.4 GB for 8 GB;
  SmolLM2 fp32: 1.8 GB for 0.6 GB, of which 0.4 GB is torch and ONNX Runtime themselves).
- ONNX Runtime's CPU sessions hold about 1.2x an fp32 target's weights; an fp16 target about 2.2x its fp16
  weights, since the CPU kernels run fp16 graphs through fp32 copies of the weights (SmolLM2: fp32 645 MB, fp16
  588 MB for the target stage alone).
"""

from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import Checkpoint, Pair

EXPORT_PEAK = 2.4
SESSIONS = {"fp32": 1.2, "fp16": 2.2}
RUNTIME = 0.5e9  # bytes of torch, ONNX Runtime and the tokenizer themselves
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def parameters(path: Path) -> int:
    """Parameters of a checkpoint directory, from its safetensors headers (nothing is loaded)."""
    numel = 0
    for shape in Checkpoint(path).shapes.values():
        n = 1
        for d in shape:
            n *= d
        numel += n
    return numel


def available() -> int | None:
    """Bytes of memory available to a new process (Linux's MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def first_use_need(pair: Pair, dtype: str = "fp32") -> tuple[int, int, int]:
    """(bytes while exporting, bytes to run, target parameters) of exporting `pair` in `dtype` and running it on
    ONNX Runtime's CPU provider."""
    target = parameters(pair.target)
    drafters = sum(parameters(p) for p in {pair.dflash, pair.domino} - {None})
    weights = (target + drafters) * BYTES[dtype]
    export = int(EXPORT_PEAK * weights + RUNTIME)
    run = int(SESSIONS[dtype] * target * BYTES[dtype] + drafters * BYTES[dtype] + RUNTIME)
    return export, run, target


def check_first_use(pair: Pair, model: str, dtype: str = "fp32", free: int | None = None):
    """A one-line refusal, with the numbers and the ways that fit, when the first-use export of `model` or its
    sessions would not fit in this machine's available memory."""
    free = available() if free is None else free
    if free is None:
        return
    export, run, target = first_use_need(pair, dtype)
    if max(export, run) <= free:
        return
    gb = 1e9
    raise DtrtError(
        f"--model {model} on ONNX Runtime: its first-use {dtype} export needs about {export / gb:.1f} GB while "
        f"exporting and {run / gb:.1f} GB to run ({target / 1e9:.2f} B target parameters), and this machine has "
        f"{free / gb:.1f} GB available; on a GPU run it with --backend torch --device cuda --dtype bf16 (or TensorRT "
        f"engines of a bf16 export), on this CPU with --backend torch --dtype bf16"
    )

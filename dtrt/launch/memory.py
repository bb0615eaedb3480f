"""Will it fit: what the first-use ONNX Runtime export of a registry model needs in memory, against what this
machine has, checked before the export starts (an export that cannot fit would run for minutes, then fail).

Measured factors (resident memory over the bytes of weights; `benchmarks/scale_check.py` at Qwen3-4B shapes and
the SmolLM2 default):
- `dtrt export` streams its weights: it peaks at about 1.25x the weights it writes plus a fixed 1 GB of tracing
  (Qwen3-4B fp16: 10.7 GB for 9.1 GB of weights; SmolLM2 fp32: 1.8 GB for 0.6 GB). A quantized target takes no
  more: the quantizer reads one weight at a time.
- ONNX Runtime's CPU sessions hold about 1.2x an fp32 export's weights and 2.2x an fp16 one's, since the CPU
  kernels run fp16 graphs through fp32 copies of the weights (Qwen3-4B fp16, every DominoTree stage: 20.7 GB for
  9.1 GB). A quantized target holds its integers and the embedding the lookup reads, at the same factor.
"""

import os
from pathlib import Path

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import Checkpoint
from dtrt.models.pair import Pair
from dtrt.models.quant_spec import QuantSpec, quant_spec

EXPORT_PEAK = 1.25
EXPORT_FIXED = 1.0e9  # bytes of tracing and graph building beyond the weights
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


def embedding_parameters(path: Path) -> int:
    """Parameters of a checkpoint's token embedding (the [vocab, hidden] lookup a quantized export keeps in its
    dtype), 0 when it has none."""
    for name, shape in Checkpoint(path).shapes.items():
        if name.endswith("embed_tokens.weight") and len(shape) == 2:
            return shape[0] * shape[1]
    return 0


def export_need(pair: Pair, dtype: str = "fp32") -> tuple[int, int, int]:
    """(bytes while exporting, target parameters, drafter parameters) of exporting `pair` in `dtype`."""
    target = parameters(pair.target)
    drafters = sum(parameters(p) for p in {pair.dflash, pair.domino} - {None})
    return int(EXPORT_PEAK * (target + drafters) * BYTES[dtype] + EXPORT_FIXED), target, drafters


def need(pair: Pair, dtype: str = "fp32", quant: QuantSpec | None = None) -> tuple[int, int, int]:
    """(bytes while exporting, bytes to run, target parameters) of exporting `pair` in `dtype` (its target's
    linear layers in `quant`) and running every stage on ONNX Runtime's CPU provider. The export is the same with or
    without `quant` (the quantizer reads one weight at a time); a quantized target's session holds its integers and
    the embedding the lookup reads, in `dtype`."""
    export, target, drafters = export_need(pair, dtype)
    size = BYTES[dtype]
    if quant is None:
        run = int(SESSIONS[dtype] * (target + drafters) * size + RUNTIME)
    else:
        held = target * (quant.bits or 8) / 8 + (embedding_parameters(pair.target) + drafters) * size
        run = int(SESSIONS[dtype] * held + RUNTIME)
    return export, run, target


def export_jobs(pair: Pair, dtype: str = "fp32", *, free: int | None = None, cores: int | None = None) -> int:
    """`dtrt export --jobs` where not given, and a first use's: 2 (the target stage in a second process, beside the
    drafter stages) on a machine of two or more cores with the memory for the second process's copy of the target
    beside this one's export; else 1 (also where the memory cannot be read). The export is the same bytes either
    way."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    free = available() if free is None else free
    if cores < 2 or free is None:
        return 1
    export, target, _ = export_need(pair, dtype)
    return 2 if export + EXPORT_PEAK * target * BYTES[dtype] + EXPORT_FIXED <= free else 1


def check_first_use(pair: Pair, model: str, dtype: str = "fp32", free: int | None = None, quant: str = "none"):
    """A one-line refusal, with the numbers and the ways that fit, when the first-use export of `model` (`quant`:
    its target's quantization) or its sessions would not fit in this machine's available memory."""
    free = available() if free is None else free
    if free is None:
        return
    export, run, target = need(pair, dtype, quant_spec(quant))
    if max(export, run) <= free:
        return
    gb = 1e9
    what = f"{dtype} export" + ("" if quant == "none" else f" with an {quant} target")
    cpu = "on this CPU with --backend torch --dtype bf16"
    for q in ("int8", "int4"):  # the CPU alternative: an fp16 export of a quantized target, when one fits
        q_export, q_run, _ = need(pair, "fp16", quant_spec(q))
        if max(q_export, q_run) <= free:
            cpu = (
                f"on this CPU with an fp16 export of an {q} target (about {q_export / gb:.1f} GB while exporting, "
                f"{q_run / gb:.1f} GB to run): dtrt export --model {model} --dtype fp16 --quant {q} --out DIR, then "
                f"--export DIR"
            )
            break
    raise DtrtError(
        f"--model {model} on ONNX Runtime: its first-use {what} needs about {export / gb:.1f} GB while "
        f"exporting and {run / gb:.1f} GB to run ({target / 1e9:.2f} B target parameters), and this machine has "
        f"{free / gb:.1f} GB available; on a GPU run it with --backend torch --device cuda --dtype bf16 (or TensorRT "
        f"engines of a bf16 export), {cpu}"
    )

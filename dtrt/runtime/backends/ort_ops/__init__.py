"""dtrt's own ONNX Runtime CPU kernels: a custom-op library built on first use from the sources here.

`tree_attention.cc` is `dtrt::TreeAttentionPlanned`, a quantized target's ordered attention, as one AVX2 kernel
instead of ~45 small nodes a layer. It is registered under the function's own domain and name, and ONNX Runtime
runs a registered kernel in place of a function's body, so exports do not change and the body stays the
definition (TensorRT's, and the fallback). Every row sums its terms in one fixed order, so tree rows still equal
plain decoding's bit for bit (`dtrt parity`'s order check runs with the kernel when the kernel is in use).

The library is compiled once per machine into `$DTRT_CACHE/ort-ops/` with the system C++ compiler. It needs no
ONNX Runtime headers (the Python wheel ships none): `ort_abi.h` declares the few entries of ONNX Runtime's C ABI it
calls, which that ABI never moves (API version 21, ONNX Runtime 1.21 on). Without a compiler, a CPU with AVX2 and
FMA, or ONNX Runtime 1.21, sessions run the function bodies as before. `DTRT_ORT_OPS=0` turns the kernel off.
"""

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from dtrt.artifacts.files import cache_dir

SOURCE = Path(__file__).with_name("tree_attention.cc")
ABI = Path(__file__).with_name("ort_abi.h")
MIN_ORT = (1, 21)  # ort_abi.h's kApiVersion
OP = "TreeAttentionPlanned"
MAX_HEAD_DIM = 128  # the kernel keeps a query and an accumulator row in registers: 16 chunks of 8


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def enabled() -> bool:
    return os.environ.get("DTRT_ORT_OPS", "1") != "0"


def status() -> str:
    """ "" when the kernel can be used here, else why not (one line)."""
    return "turned off (DTRT_ORT_OPS=0)" if not enabled() else _machine()


def unavailable() -> str:
    """ "" when quantized targets' sessions run the kernel here (built), else why they run the function body."""
    why = status()
    if not why and library() is None:
        why = f"its build failed (c++ on {SOURCE.name})"
    return why


@functools.cache
def _machine() -> str:
    """What this machine lacks for the kernel ("" for nothing), checked once per process."""
    if not {"avx2", "fma"} <= cpu_flags():
        return "this CPU lacks AVX2 or FMA"
    import onnxruntime

    version = onnxruntime.__version__
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < MIN_ORT:
        return f"ONNX Runtime {version} is older than {'.'.join(map(str, MIN_ORT))}"
    if shutil.which("c++") is None:
        return "no C++ compiler (c++)"
    return ""


@functools.cache
def library() -> Path | None:
    """The built library, compiled on first use; None where status() says why, or when the build fails."""
    if status():
        return None
    flags = ["-O2", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17"]
    key = hashlib.sha256(SOURCE.read_bytes() + ABI.read_bytes() + " ".join(flags).encode()).hexdigest()
    out = cache_dir() / "ort-ops" / key[:16] / "libdtrt_ort_ops.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        cmd = ["c++", *flags, str(SOURCE), "-o", str(built)]  # ort_abi.h: beside the source
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        os.replace(built, out)  # whole or not at all, also when processes build it side by side
    return out


def wants_kernel(path) -> bool:
    """Whether the stage at `path` has ordered-attention nodes the kernel serves: fp32 caches that each node reads
    whole (exports of layout 11 on; earlier ones run the function body), a head dim that is a multiple of 8 and at
    most MAX_HEAD_DIM."""
    import onnx  # a session's start only (`dtrt run` imports no onnx otherwise)

    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == OP]
    if not nodes or any(n.input[1] != "past_k" or n.input[3] != "past_v" for n in nodes):
        return False
    past = next((i.type.tensor_type for i in model.graph.input if i.name == "past_v"), None)
    if past is None or past.elem_type != onnx.TensorProto.FLOAT:
        return False
    hd = past.shape.dim[-1].dim_value
    return 0 < hd <= MAX_HEAD_DIM and hd % 8 == 0

"""dtrt's own ONNX Runtime CPU kernels: one custom-op library built on first use from the sources here
(`register.cc` registers every kernel under domain `dtrt`).

`tree_attention.cc` is `dtrt::TreeAttentionPlanned`, a quantized target's ordered attention, as one AVX2 kernel instead
of ~45 small nodes a layer, its KV heads' rows shared among the session's intra-op threads. `block_matmul.cc` is
`dtrt::BlockMatMul` and `dtrt::BlockMatMulMin`, the product of fp32 activations with a GGUF file's 4- and 8-bit blocks
(dtrt.ops.functions.block_matmul), read as packed codes instead of fp32 weights. Each is registered under the function's
own domain and name, and ONNX Runtime runs a registered kernel in place of a function's body, so exports do not change
and the body stays the definition (TensorRT's, and the fallback). Every output sums its terms in one fixed order,
whatever the rows of the call and the threads: tree rows still equal plain decoding's bit for bit (`dtrt parity`'s order
check runs with the kernels when they are in use), and a block product's row is the same in a 1-row call and in a 64-row
one. The block product has an AVX-512F path beside its AVX2 one, taken where the CPU has AVX-512F: 16-lane sums instead
of 8, its own fixed order, so an output can differ in its last bits between an AVX-512 CPU and an AVX2-only one (as ONNX
Runtime's own kernels' do). `DTRT_BLOCK_ISA=avx2`, read when a session creates the kernel, keeps it on the AVX2 path;
`block_isa()` says which path a session created now takes.

The library is compiled once per machine into `$DTRT_CACHE/ort-ops/` with the system C++ compiler. It needs no
ONNX Runtime headers (the Python wheel ships none): `ort_abi.h` declares the few entries of ONNX Runtime's C ABI it
calls, which that ABI never moves (API version 21, ONNX Runtime 1.21 on). Without a compiler, a CPU with AVX2 and
FMA, or ONNX Runtime 1.21, sessions run the function bodies as before. `DTRT_ORT_OPS=0` turns the kernels off.
"""

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from dtrt.artifacts import memo
from dtrt.artifacts.files import cache_dir
from dtrt.plugins import DOMAIN

HERE = Path(__file__).parent
SOURCES = tuple(HERE / n for n in ("register.cc", "tree_attention.cc", "block_matmul.cc"))
HEADERS = tuple(HERE / n for n in ("ort_abi.h", "kernels.h"))
ABI = HERE / "ort_abi.h"
# -ffp-contract=off: no multiply and add fused unless written as an FMA (the kernels' orders are written out)
FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++17")
MIN_ORT = (1, 21)  # ort_abi.h's kApiVersion
OP = "TreeAttentionPlanned"
BLOCK_OPS = ("BlockMatMul", "BlockMatMulMin")
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
        why = f"its build failed (c++ on {', '.join(s.name for s in SOURCES)})"
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


_building = threading.Lock()


def library() -> Path | None:
    """The built library, compiled on first use; None where status() says why, or when the build fails. A call
    while another thread builds it waits for that build (build_in_background)."""
    with _building:
        return _built()


def build_in_background() -> None:
    """Start compiling the library on a thread of its own, for a process that will open a quantized target's
    sessions after other work (a first use's conversion and export): the compile (15 s on a 2-core machine, most of
    it block_matmul.cc) shares the cores with that work instead of delaying the first answer. A call while the
    library is built or being built costs a thread that finds it. Not a daemon: a process that ends meanwhile waits
    for the compiler rather than leaving its scratch folder in the cache."""
    if not status():
        threading.Thread(target=library, name="dtrt-ort-ops-build").start()


@functools.cache
def _built() -> Path | None:
    if status():
        return None
    text = b"".join(f.name.encode() + f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()
    out = cache_dir() / "ort-ops" / key[:16] / "libdtrt_ort_ops.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        cmd = ["c++", *FLAGS, *map(str, SOURCES), "-o", str(built)]  # the headers: beside the sources
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        os.replace(built, out)  # whole or not at all, also when processes build it side by side
    return out


def block_isa() -> str:
    """The path BlockMatMul[Min]'s kernel takes in a session created now: "avx512f" on a CPU with AVX-512F unless
    DTRT_BLOCK_ISA=avx2, else "avx2" (the kernel asks the CPU and reads the variable the same way)."""
    if "avx512f" in cpu_flags() and os.environ.get("DTRT_BLOCK_ISA") != "avx2":
        return "avx512f"
    return "avx2"


# what wants_kernel's answer depends on besides the graph: a change to its rule changes this, and so its memo's key
KERNEL_RULE = f"wants-kernel/1/{OP}/{'+'.join(BLOCK_OPS)}/hd<={MAX_HEAD_DIM}"


def wants_kernel(path) -> bool:
    """Whether the stage at `path` should run with the library: it has nodes the library serves, and none it would
    take over without serving. The library replaces every node of the names it registers, so a graph with
    ordered-attention nodes gets it only where the kernel serves them all: fp32 caches that each node reads whole
    (exports of layout 11 on; earlier ones run the function body), a head dim that is a multiple of 8 and at most
    MAX_HEAD_DIM. BlockMatMul and BlockMatMulMin nodes are served whatever their shapes. Read from the graph once
    per file as it is (dtrt.artifacts.memo): importing onnx to read it cost 0.6 s of every start."""
    return memo.stamped(KERNEL_RULE, [Path(path)], lambda: _serves(path))


def _serves(path) -> bool:
    import onnx  # a file's first session only (`dtrt run` imports no onnx otherwise)

    model = onnx.load(str(path), load_external_data=False)
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    attention = [n for n in nodes if n.op_type == OP and n.domain == DOMAIN]
    blocks = any(n.op_type in BLOCK_OPS and n.domain == DOMAIN for n in nodes)
    if not attention:
        return blocks
    if any(n not in model.graph.node or n.input[1] != "past_k" or n.input[3] != "past_v" for n in attention):
        return False
    past = next((i.type.tensor_type for i in model.graph.input if i.name == "past_v"), None)
    if past is None or past.elem_type != onnx.TensorProto.FLOAT:
        return False
    hd = past.shape.dim[-1].dim_value
    return 0 < hd <= MAX_HEAD_DIM and hd % 8 == 0

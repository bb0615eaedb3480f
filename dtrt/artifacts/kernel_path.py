"""Which kernel path ONNX Runtime's CPU provider takes on this processor, and how to run a process on another one.

Exactness holds per export on one machine; whether two CPUs give the same tokens depends on the kernels their
instruction sets select. ONNX Runtime's MLAS library picks its GEMM kernels at start from CPUID: AMX where the tile
and int8 units are there, AVX-512 with VNNI (int8 dot products in one instruction), AVX-512, AVX2 with AVX-VNNI,
AVX2 with FMA, else SSE. Its int8-activation kernels (MatMulNBits at accuracy level 4) round differently on each
path, so a quantized target's tokens can differ between machines (measured: 92% of greedy tokens the same between
the AVX-512 VNNI and the AVX2 path on SmolLM2's int8 target); fp32 kernels differ only in the order of their sums.

MLAS has no switch that keeps it off a path it detects. A process can still be put on another path by running it
under QEMU's user-mode emulator with a CPU model that lacks the instructions (`qemu-x86_64 -cpu Haswell`: AVX2 and
FMA, no AVX-512): the real kernel code of that path runs, about 150x slower.
"""

import os
import shutil
import sys
from pathlib import Path

# (path, the /proc/cpuinfo flags it needs), in MLAS's order of preference
PATHS = (
    ("amx", ("amx_tile", "amx_int8", "avx512f", "avx512bw")),
    ("avx512-vnni", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")),
    ("avx512", ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    ("avx2-vnni", ("avx2", "fma", "avx_vnni")),
    ("avx2", ("avx2", "fma")),
)
# the paths a process can be moved to on an x86-64 machine: QEMU CPU models without the instructions above them
EMULATED = {"avx2": "Haswell"}
QEMU = "qemu-x86_64"


def kernel_path(flags: set[str]) -> str:
    """The kernel path MLAS takes on a CPU with these /proc/cpuinfo flags (`sse` when none of the others)."""
    for name, needs in PATHS:
        if all(f in flags for f in needs):
            return name
    return "sse"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none: not Linux, not x86)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def this_path() -> str:
    """This machine's kernel path (`unknown` off x86-64 Linux)."""
    flags = cpu_flags()
    return kernel_path(flags) if flags else "unknown"


def emulated_command(path: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that runs `python argv...` on kernel path `path` under QEMU. The interpreter cannot
    find its virtual environment from inside the emulator, so the child gets this process's sys.path as PYTHONPATH.
    DtrtError-free: raises ValueError with a one-line reason when the path or QEMU is not available."""
    if path not in EMULATED:
        raise ValueError(f"{path!r}: emulated kernel paths are {', '.join(EMULATED)}")
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise ValueError(f"{QEMU} not found: apt-get install qemu-user (Debian, Ubuntu)")
    python = os.path.realpath(sys.executable)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return [qemu, "-cpu", EMULATED[path], python, *argv], env

"""Timing hygiene stated with every bench: the machine (CPU model, cores, the instruction sets that decide which
kernels run; on ONNX Runtime's CPU provider, which attention a quantized target ran; at the end, how much of the
process's memory lay in huge pages, dtrt.hugepages), the threads each process uses, and whether another process
held a core (the load average before the run, and after it beyond the bench's own threads)."""

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
         "amx_int8", "asimd", "sve", "i8mm", "bf16")  # fmt: skip
BUSY = 0.5  # load from other processes above this: they held (part of) a core


def cpu() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def ort_attention() -> str:
    """Which attention ONNX Runtime runs for a quantized target here: dtrt's kernel (dtrt.runtime.backends.ort_ops),
    or the ordered attention's function body and why the kernel is not there."""
    from dtrt.runtime.backends import ort_ops

    why = ort_ops.unavailable()
    return f"the ONNX function body ({why})" if why else "dtrt's kernel"


def load() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def hygiene(machine: dict, threads: dict, before: float | None, after: float | None) -> dict:
    """What the report says about the conditions of the timings. `threads`: what each process ran with."""
    own = max([t for t in threads.values() if t] or [1])
    others_before = before
    others_after = None if after is None else max(0.0, after - own)
    busy = [w for w, v in (("before", others_before), ("during", others_after)) if v is not None and v > BUSY]
    return {"machine": machine, "threads": threads, "load_before": before, "load_after": after, "busy": busy}


def describe(h: dict) -> str:
    """One line for the report and the log."""
    m = h["machine"]
    threads = ", ".join(f"{k} {v if v else 'default'}" for k, v in h["threads"].items())
    load = ""
    if h["load_before"] is not None and h["load_after"] is not None:
        load = f"; load average {h['load_before']:.2f} before, {h['load_after']:.2f} after"
    if h["busy"]:
        verdict = f"; another process held a core {' and '.join(h['busy'])} the run: the timings shared the machine"
    elif load:
        verdict = "; no other process held a core"
    else:
        verdict = ""
    flags = f" ({' '.join(m['flags'])})" if m["flags"] else ""
    attention = f"; quantized targets' attention: {m['attention']}" if m.get("attention") else ""
    memory = f"; host memory: {m['host_memory']}" if m.get("host_memory") else ""
    peer = f"; llama.cpp: {m['peer']}" if m.get("peer") else ""
    return (
        f"machine: {m['model']}, {m['cores']} cores{flags}{attention}{memory}; threads per process: {threads}{load}"
        f"{verdict}{peer}"
    )

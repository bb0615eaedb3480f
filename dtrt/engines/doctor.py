"""`dtrt doctor`: which backends, devices, TensorRT version and plugin libraries this machine has, and for
each one that is missing, why and what to do.

Every probe is a function of the results before it, so a test can replace any of them with a fake.
"""

import os
import platform
import sys
from dataclasses import asdict, dataclass

from dtrt import __version__
from dtrt.artifacts.gpu import TRT_INSTALL, cuda_status, tensorrt_status
from dtrt.artifacts.kernel_path import this_path
from dtrt.errors import first_line
from dtrt.plugins import NAMESPACE, OPS, PLUGIN_VERSION, triton_status


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""  # what is there (version, devices, ...)
    why: str = ""  # when not ok: the reason and the fix


def _python(r):
    return Check("python", True, f"{platform.python_version()} ({sys.executable})")


def _torch(r):
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return Check("torch", True, f"{torch.__version__} ({build})")


def _onnxruntime(r):
    try:
        import onnxruntime as ort
    except Exception as e:
        return Check("onnxruntime", False, why=f"cannot be imported ({first_line(e)}); pip install onnxruntime")
    return Check("onnxruntime", True, f"{ort.__version__}, providers {', '.join(ort.get_available_providers())}")


def _kernel_path(r):
    path = this_path()
    if path == "unknown":
        return Check("CPU kernel path", True, "unknown (no x86-64 /proc/cpuinfo)")
    from dtrt.runtime.backends import ort_ops

    why = "--quant int8/int4 round their int8 activations per path, so tokens can differ between machines"
    detail = f"{path} (ONNX Runtime's MLAS kernels; {why})"
    if not ort_ops.status():  # dtrt's kernel for --quant gguf's block products (BlockMatMul) has paths of its own
        detail += f"; --quant gguf's block kernel: {ort_ops.block_isa()}"
        if ort_ops.block_isa() == "avx512f":
            detail += " (DTRT_BLOCK_ISA=avx2 for its AVX2 path)"
    return Check("CPU kernel path", True, detail)


def _ort_kernel(r):
    from dtrt.runtime.backends import ort_ops

    if not r["onnxruntime"].ok:
        return Check("ORT attention", False, why="needs onnxruntime")
    if why := ort_ops.unavailable():
        return Check("ORT attention", False, why=f"quantized targets run the ONNX function body: {why}")
    return Check("ORT attention", True, f"dtrt's kernel for quantized targets ({ort_ops.library()})")


def _cuda(r):
    devices, why = cuda_status()
    return Check(
        "CUDA devices", bool(devices), "; ".join(f"cuda:{i} {n} (sm {cc})" for i, (n, cc) in enumerate(devices)), why
    )


def _triton(r):
    version, why = triton_status()
    return Check("Triton", version is not None, version or "", why)


def _tensorrt(r):
    version, why = tensorrt_status()
    return Check("TensorRT", version is not None, version or "", why)


def _builder(r):
    missing = [c for c in (r["TensorRT"], r["CUDA devices"]) if not c.ok]
    if missing:
        return Check("TensorRT builder", False, why=f"needs {' and '.join(c.name for c in missing)} (see above)")
    import tensorrt as trt

    try:
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as e:
        builder, err = None, first_line(e)
    else:
        err = "it returned nothing"
    if builder is None:
        return Check(
            "TensorRT builder",
            False,
            why=f"TensorRT cannot create a builder ({err}): CUDA failed to initialize for it; check the driver",
        )
    return Check("TensorRT builder", True, f"TensorRT {trt.__version__} can build on this GPU")


def _plugins(r):
    ops = ", ".join(OPS)
    missing = [c for c in (r["TensorRT builder"], r["Triton"]) if not c.ok]
    if missing:
        return Check(
            "plugin libraries",
            False,
            why=f"the dtrt plugins ({ops}; {NAMESPACE} v{PLUGIN_VERSION}) need "
            f"{' and '.join(c.name for c in missing)} (see above)",
        )
    import tensorrt as trt

    from dtrt.plugins.trt import register_plugins, registered_plugins

    standard = trt.init_libnvinfer_plugins(trt.Logger(trt.Logger.ERROR), "")
    cc = cuda_status()[0][0][1]
    try:
        register_plugins(cc)
        have = registered_plugins()
    except Exception as e:
        return Check("plugin libraries", False, why=f"registering the dtrt plugins failed ({first_line(e)})")
    lost = [op for op in OPS if f"{NAMESPACE}::{op}" not in have]
    if lost:
        return Check("plugin libraries", False, why=f"TensorRT's registry lacks {', '.join(lost)} after registration")
    std = "libnvinfer_plugin loaded" if standard else "libnvinfer_plugin not loaded"
    return Check("plugin libraries", True, f"{std}; dtrt {', '.join(OPS)} (v{PLUGIN_VERSION}, AOT Triton, sm {cc})")


PROBES = {
    "python": _python,
    "torch": _torch,
    "onnxruntime": _onnxruntime,
    "CPU kernel path": _kernel_path,
    "ORT attention": _ort_kernel,
    "CUDA devices": _cuda,
    "Triton": _triton,
    "TensorRT": _tensorrt,
    "TensorRT builder": _builder,
    "plugin libraries": _plugins,
}


def _torch_devices(r: dict) -> str:
    """The torch backend's devices, and what runs the dtrt ops on CUDA (dtrt.ops.kernels)."""
    if not r["CUDA devices"].ok:
        return "cpu"
    if os.environ.get("DTRT_KERNELS") == "ref":
        return "cpu, cuda (DTRT_KERNELS=ref: the ops run their PyTorch references)"
    if not r["Triton"].ok:
        return f"cpu, cuda (the ops run their PyTorch references: {r['Triton'].why})"
    return "cpu, cuda (the ops run their Triton kernels)"


def backend_checks(r: dict) -> list[Check]:
    """The runtime backends `dtrt run --backend` offers, from the probe results."""
    torch_ = Check("torch", True, _torch_devices(r))
    ort = Check("onnxruntime", r["onnxruntime"].ok, r["onnxruntime"].detail, r["onnxruntime"].why)
    need = [r[n] for n in ("TensorRT", "CUDA devices", "TensorRT builder", "plugin libraries")]
    bad = next((c for c in need if not c.ok), None)
    trt = Check(
        "tensorrt",
        bad is None,
        "engines from `dtrt build-engine`" if bad is None else "",
        "" if bad is None else f"{bad.name}: {bad.why}",
    )
    return [torch_, ort, trt]


def run_checks(probes: dict | None = None) -> tuple[list[Check], list[Check]]:
    """(machine checks, backend checks); `probes` replaces probes by name (fakes in tests)."""
    fns = {**PROBES, **(probes or {})}
    results: dict[str, Check] = {}
    for name in PROBES:
        try:
            results[name] = fns[name](results)
        except Exception as e:  # a probe that breaks is itself a finding
            results[name] = Check(name, False, why=f"the probe failed ({first_line(e)})")
    return list(results.values()), backend_checks(results)


def render(checks: list[Check], backends: list[Check]) -> str:
    def rows(items):
        return [f"  {'ok' if c.ok else '--'}  {c.name:<17} {c.detail if c.ok else c.why}" for c in items]

    return "\n".join([f"dtrt {__version__} doctor", *rows(checks), "backends", *rows(backends)])


def to_json(checks: list[Check], backends: list[Check]) -> dict:
    return {
        "dtrt_version": __version__,
        "checks": [asdict(c) for c in checks],
        "backends": {c.name: asdict(c) for c in backends},
        "trt_install": TRT_INSTALL,
    }

"""TensorRT plugins for the dtrt ops (DESIGN.md section 5): Triton kernels, one module per op.

Each op module holds the kernel, a torch launcher (`run`, on CUDA tensors: the GPU tests compare it with the
op's eager reference in dtrt.ops) and the launch configuration both the launcher and TensorRT use. trt.py
registers every op with TensorRT's Python plugin API under the ONNX node's name, version and namespace, with
an ahead-of-time implementation: the kernel is compiled to PTX for the build GPU and embedded in the plan, so
running an engine needs no Python. static_tree_attention is the torch backend's alone (the --static-shapes
verify's attention; no ONNX node, not in OPS). Importing this package needs neither Triton nor TensorRT.
"""

import hashlib
from pathlib import Path

# the exported nodes' domain and version (dtrt.ops.base) are the plugins' namespace and version
DOMAIN, VERSION = "dtrt", 1
NAMESPACE, PLUGIN_VERSION = DOMAIN, str(VERSION)
OPS = ("TreeAttention", "TopMCorrectedScore", "LedgerSelect", "TreeGatedDeltaNet", "TreeCausalConv1d")
TRITON_INSTALL = 'pip install "dtrt[gpu]"'


def sources_sha256() -> str:
    """sha256 over this package's sources: an engine records it, so plans built with other kernels are refused."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def triton_status() -> tuple[str | None, str]:
    """(Triton version, "") or (None, why it is not usable)."""
    try:
        import triton
    except ModuleNotFoundError:
        return None, f"Triton is not installed ({TRITON_INSTALL}; it comes with CUDA builds of torch on Linux)"
    except Exception as e:
        return None, f"Triton is installed but cannot be imported ({e.__class__.__name__}: {str(e)[:120]})"
    return triton.__version__, ""

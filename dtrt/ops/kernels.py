"""Which implementation an eager dtrt op call runs: the PyTorch reference, or the op's Triton kernel from
dtrt.plugins (the torch backend's GPU fast path; TensorRT runs the same kernels).

DTRT_KERNELS=auto (the default): the kernel for batch-free inputs on a CUDA device when Triton imports and no
input needs a gradient (the kernels have no backward); the reference otherwise.
DTRT_KERNELS=ref: always the reference.
DTRT_KERNELS=triton: the kernel for every batch-free call, on any device. CPU tensors need Triton's interpreter
(TRITON_INTERPRET=1, set before dtrt.plugins is imported): that is how the CPU tests run the kernels inside the
decode loop.
"""

import functools
import importlib
import os

import torch

from dtrt.errors import DtrtError

MODES = ("auto", "ref", "triton")


def mode() -> str:
    m = os.environ.get("DTRT_KERNELS", "auto")
    if m not in MODES:
        raise DtrtError(f"DTRT_KERNELS={m!r}: use one of {', '.join(MODES)}")
    return m


@functools.cache
def _triton_why() -> str:
    from dtrt.plugins import triton_status

    return triton_status()[1]


@functools.cache
def _launcher(op: str):
    return importlib.import_module(f"dtrt.plugins.{op}").run


def kernel(op: str, *inputs: torch.Tensor):
    """The launcher `run` of dtrt.plugins.<op> for these inputs (same arguments as the op's reference), or None
    when the reference should run."""
    m = mode()
    if m == "ref" or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return None
    if m == "auto" and not (inputs[0].is_cuda and not _triton_why()):
        return None
    if _triton_why():
        raise DtrtError(f"DTRT_KERNELS=triton: {_triton_why()}")
    return _launcher(op)

"""The machine a TensorRT plan is built for (its engine key), where its engine directory lives, and what this
machine has (TensorRT, CUDA devices).

A plan runs only on the TensorRT version and GPU architecture it was built with, so engines are kept per
machine: `<root>/<gpu-name>-sm<cc>-trt<version>-cu<cuda>/<model>/`.
"""

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrt.errors import DtrtError, first_line

TRT_INSTALL = 'pip install "dtrt[trt]" on a machine with a CUDA GPU'
LABELS = {
    "gpu_name": "GPU",
    "compute_capability": "compute capability",
    "tensorrt_version": "TensorRT",
    "cuda_version": "CUDA",
}


@dataclass(frozen=True)
class Machine:
    gpu_name: str  # as CUDA reports it, e.g. "NVIDIA H200"
    compute_capability: str  # "9.0"
    tensorrt_version: str  # "11.4.0.106"
    cuda_version: str  # the CUDA runtime of torch, which owns the device buffers: "12.8"

    @property
    def key(self) -> str:
        return (
            f"{slug(self.gpu_name)}-sm{self.compute_capability.replace('.', '')}"
            f"-trt{self.tensorrt_version}-cu{self.cuda_version}"
        )

    def to_json(self) -> dict:
        return asdict(self)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "gpu"


def engine_dir(root, machine: Machine, model: str) -> Path:
    return Path(root) / machine.key / model


def tensorrt_status() -> tuple[str | None, str]:
    """(TensorRT version, "") or (None, why it is not usable)."""
    try:
        import tensorrt
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("tensorrt", "tensorrt_bindings"):
            return None, f"TensorRT is not installed ({TRT_INSTALL})"
        return None, f"TensorRT is installed but cannot be imported ({first_line(e)})"
    except Exception as e:  # missing shared libraries surface as ImportError or OSError
        return None, f"TensorRT is installed but cannot be loaded ({first_line(e)}); reinstall it with {TRT_INSTALL}"
    return tensorrt.__version__, ""


def cuda_status() -> tuple[list[tuple[str, str]], str]:
    """([(name, compute capability)] of the visible CUDA devices, "") or ([], why there are none)."""
    import torch

    if torch.version.cuda is None:
        return [], f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    if not torch.cuda.is_available():
        return [], (
            f"no CUDA device is visible to torch {torch.__version__} (CUDA {torch.version.cuda}): check the "
            f"driver and CUDA_VISIBLE_DEVICES"
        )
    return [
        (torch.cuda.get_device_name(i), "{}.{}".format(*torch.cuda.get_device_capability(i)))
        for i in range(torch.cuda.device_count())
    ], ""


def probe_machine(what: str, device: int = 0) -> Machine:
    """This machine's engine key; `what` needs TensorRT and a CUDA GPU, and the error says which is missing."""
    version, why = tensorrt_status()
    if version is None:
        raise DtrtError(f"{what} needs TensorRT and a CUDA GPU: {why}")
    devices, why = cuda_status()
    if not devices:
        raise DtrtError(f"{what} needs TensorRT and a CUDA GPU: {why}")
    import torch

    name, cc = devices[device]
    return Machine(name, cc, version, torch.version.cuda)

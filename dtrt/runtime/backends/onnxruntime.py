"""The ONNX Runtime backend: the stages of an export directory (dtrt export), one InferenceSession per stage,
loaded once, on the CPU or on a GPU through onnxruntime-gpu's CUDA execution provider.

CPU: inputs go in as numpy views of the torch tensors (ONNX Runtime wraps contiguous arrays without a copy) and
outputs come back as numpy arrays over ONNX Runtime's own buffers, wrapped by torch.from_numpy (no copy). IO
binding, rebound on every call as the shapes change, saves no copy on top of that on the CPU and measured slower,
so plain `run` is used there.
CUDA: every input is bound where it lies (device tensors: the K/V caches, the recurrent state, the drafter rows)
and every output is left on the device and read through DLPack, so no round copies the past to the host.
"""

import importlib.metadata

import numpy as np
import torch

from dtrt.artifacts.export import Export
from dtrt.errors import DtrtError
from dtrt.runtime.backends import ort_ops
from dtrt.runtime.backends.exported import SCORER_STAGES, ExportedBackend, StageRunner

ORT_TYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}
NUMPY_TYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
    torch.bfloat16: 16,  # onnx.TensorProto.BFLOAT16: numpy has no bfloat16, bind_input takes the ONNX type number
}
GPU_INSTALL = "pip uninstall -y onnxruntime && pip install onnxruntime-gpu"


def ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def providers_for(device: torch.device, available: list[str], stream: int | None = None) -> list:
    """The execution providers of a session on `device`: the CPU provider on the CPU; on a CUDA device the CUDA
    provider on that device (on torch's stream `stream`, so its work is ordered with torch's), with the CPU provider
    for the nodes it does not take. A one-line error with the install command where the CUDA provider is absent."""
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        try:
            gpu = importlib.metadata.version("onnxruntime-gpu")
        except importlib.metadata.PackageNotFoundError:
            gpu = None
        why = (
            f"onnxruntime-gpu {gpu} is installed but its CUDA provider does not load (check the CUDA and cuDNN "
            f"libraries it needs)"
            if gpu
            else f"onnxruntime {ort_version()} has no CUDA provider (available: {', '.join(available)}); {GPU_INSTALL}"
        )
        raise DtrtError(f"--device {device}: {why}")
    options = {"device_id": str(device.index or 0)}
    if stream is not None:
        options.update(has_user_compute_stream="1", user_compute_stream=str(stream))
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


# ONNX Runtime fuses a quantized target's DequantizeLinear -> MatMul pairs into MatMulNBits; at accuracy level 4 its
# CPU kernel quantizes the activations to int8 per block (about 3x faster than fp32 ones at batch 1). Set rather
# than left to ONNX Runtime's default, which has changed between versions.
MATMUL_ACCURACY = 4
# MatMulAddFusion turns a quantized linear followed by its residual Add into a Gemm on the dequantized weights
# before the DequantizeLinear -> MatMul pair can become MatMulNBits: a quantized SmolLM2's o_proj and down_proj
# (60 of 211 linears) then dequantized every weight on every call and ran slower than fp32
DISABLED_OPTIMIZERS = ["MatMulAddFusion"]


# Domino's scorer stages take a few small fixed-size inputs (a call of 0.1-0.4 ms on SmolLM2, no faster on two
# threads): on the CPU they run on one thread, so their sessions have no pool. A pool's worker spins for work as soon
# as it starts, before it first blocks (50-100 ms of a core, seen in /proc), which on two cores took the CPU from the
# other sessions' creation and the target's first call (the prefill's first chunk: about 180 ms against 50 ms after)
ONE_THREAD_STAGES = frozenset(SCORER_STAGES)


def make_session(
    path,
    threads: int | None = None,
    providers: list | None = None,
    accuracy: int = MATMUL_ACCURACY,
    optimized=None,
    profile: str | None = None,
    kernels: bool = True,
):
    """An InferenceSession configured as every dtrt stage runs (on the CPU also what `dtrt parity` measures);
    `accuracy`: the fused MatMulNBits kernels' accuracy level (0: fp32 activations, what parity checks weights with);
    `optimized`: a path to write the graph as ONNX Runtime optimized it; `profile`: a file prefix for ONNX Runtime's
    per-node profile (`end_profiling()` names the file); `kernels`: dtrt's ONNX Runtime kernels where they serve the
    graph and can be built here (dtrt.runtime.backends.ort_ops; DTRT_ORT_OPS=0 turns them off everywhere)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    providers = providers or ["CPUExecutionProvider"]
    on_cpu = providers == ["CPUExecutionProvider"]
    # On the CPU the intra-op threads spin between a call's parallel sections (a decode call runs hundreds of small
    # ones: SmolLM2's 2-thread AR step took 10.9 ms with its second thread woken from sleep for each, 8.5-9.2 ms
    # spinning, 12.2 ms on one thread) and stop when the call returns, so they never spin through the host's tree
    # code between stage calls
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if on_cpu else "0")
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    if threads:
        opts.intra_op_num_threads = threads
    if optimized is not None:
        opts.optimized_model_filepath = str(optimized)
    if profile is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile)
    if kernels and on_cpu and not ort_ops.status() and ort_ops.wants_kernel(path):
        if (lib := ort_ops.library()) is not None:
            opts.register_custom_ops_library(str(lib))  # runs in place of the function bodies of the nodes it serves
    return ort.InferenceSession(str(path), opts, providers=providers, disabled_optimizers=DISABLED_OPTIMIZERS)


def cpu_session(
    path, threads: int | None = None, accuracy: int = MATMUL_ACCURACY, optimized=None, kernels: bool = True
):
    return make_session(path, threads, ["CPUExecutionProvider"], accuracy, optimized, kernels=kernels)


_EMPTY: dict[torch.device, torch.Tensor] = {}


def empty_address(device: torch.device) -> int:
    """A valid address on `device` for a zero-size input: torch reports 0 as an empty tensor's data_ptr (even for
    a zero-length view into a buffer, as the past is before the prefill), and a bound input should not be null."""
    if device not in _EMPTY:
        _EMPTY[device] = torch.empty(16, dtype=torch.uint8, device=device)
    return _EMPTY[device].data_ptr()


def binding_plan(feeds: dict[str, torch.Tensor]) -> list[tuple]:
    """(name, device type, device id, numpy element type, shape, address) per input, as IoBinding.bind_input takes
    them: every tensor bound where it lies (a zero-size one at a valid address on its device)."""
    plan = []
    for name, t in feeds.items():
        if not t.is_contiguous():
            raise ValueError(f"input {name}: IO binding needs a contiguous tensor")
        if t.dtype not in NUMPY_TYPES:
            raise ValueError(f"input {name}: IO binding takes no {t.dtype} tensors")
        kind = "cuda" if t.device.type == "cuda" else "cpu"
        address = t.data_ptr() if t.numel() else empty_address(t.device)
        plan.append((name, kind, t.device.index or 0, NUMPY_TYPES[t.dtype], tuple(t.shape), address))
    return plan


class OrtRunner(StageRunner):
    name = "onnxruntime"

    def __init__(
        self,
        export: Export,
        threads: int | None = None,
        device="cpu",
        binding: bool | None = None,
        accuracy: int = MATMUL_ACCURACY,
        kernels: bool = True,
    ):
        """`binding`: run through IO binding (default: on a CUDA device only; the CPU tests also run it);
        `accuracy`: the quantized MatMuls' accumulation (make_session; dtrt quality compares settings); `kernels`:
        dtrt's ONNX Runtime kernels where they serve the graph (make_session; benchmarks time without them)."""
        import onnxruntime as ort

        self.export, self.threads, self.device, self.accuracy = export, threads, torch.device(device), accuracy
        self.kernels = kernels
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        self.providers = providers_for(self.device, ort.get_available_providers(), stream)
        self.binding = self.device.type == "cuda" if binding is None else binding
        self.sessions: dict = {}
        self.types: dict[str, dict[str, torch.dtype]] = {}
        self.outputs: dict[str, list[str]] = {}

    def cost_key(self) -> dict:
        import onnxruntime as ort

        providers = [p if isinstance(p, str) else p[0] for p in self.providers]
        return {
            "runner": self.name,
            "onnxruntime": ort.__version__,
            "threads": self.threads,
            "intra_op": "spins within a call",  # curves measured with sleeping threads (an earlier dtrt) are not reused
            "providers": providers,
        }

    def open(self, stage: str):
        if stage in self.sessions:
            return
        exp = self.export
        path = exp.stage(stage)
        threads = 1 if stage in ONE_THREAD_STAGES and self.providers == ["CPUExecutionProvider"] else self.threads
        try:
            sess = make_session(path, threads, self.providers, self.accuracy, kernels=self.kernels)
        except Exception as e:  # ONNX Runtime raises its own exception types for unreadable or invalid graphs
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise DtrtError(
                f"{path}: ONNX Runtime cannot load it ({e.__class__.__name__}: {first}); re-export with "
                f"`{exp.fix_hint()}`"
            ) from None
        meta = exp.manifest["stages"][stage]
        got = ([i.name for i in sess.get_inputs()], [o.name for o in sess.get_outputs()])
        if got != (meta["inputs"], meta["outputs"]):
            raise DtrtError(
                f"{path}: inputs/outputs {got[0]} -> {got[1]} differ from the manifest's "
                f"{meta['inputs']} -> {meta['outputs']}; re-export with `{exp.fix_hint()}`"
            )
        self.sessions[stage] = sess
        self.types[stage] = {i.name: ORT_TYPES[i.type] for i in sess.get_inputs()}
        self.outputs[stage] = got[1]

    def inputs(self, stage: str) -> dict[str, torch.dtype]:
        return self.types[stage]

    def run(self, stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sess, names = self.sessions[stage], self.outputs[stage]
        if not self.binding:
            outs = sess.run(None, {n: t.numpy() for n, t in feeds.items()})
            return {n: torch.from_numpy(o) for n, o in zip(names, outs)}
        io = sess.io_binding()
        for args in binding_plan(feeds):
            io.bind_input(*args)
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        for n in names:
            io.bind_output(n, kind, self.device.index or 0)
        sess.run_with_iobinding(io)
        return {n: torch.from_dlpack(v) for n, v in zip(names, io.get_outputs())}


class OrtBackend(ExportedBackend):
    @classmethod
    def check(cls, spec, exp: Export) -> str | None:
        """The export checks, then ONNX Runtime's own: its CPU provider has no bf16 kernels."""
        kind = super().check(spec, exp)
        if exp.dtype == "bf16" and spec.device == "cpu":
            raise DtrtError(
                f"{exp.path} holds bf16 graphs, which ONNX Runtime's CPU provider cannot run (it has no bf16 kernels); "
                f"build TensorRT engines from it (`dtrt build-engine {exp.path} --out ENGINES`, then --engines "
                f"ENGINES), or re-export for the CPU with `{exp.fix_hint(dtype='fp32')}`"
            )
        return kind

    @classmethod
    def over(cls, spec, sources, kind):
        return cls(sources.export, kind, spec.threads, spec.device)

    def __init__(self, export: Export, kind: str | None = None, threads: int | None = None, device="cpu", binding=None):
        super().__init__(OrtRunner(export, threads, device, binding), kind)

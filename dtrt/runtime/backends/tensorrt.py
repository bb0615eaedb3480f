"""The TensorRT backend: the plans of an engine directory (dtrt build-engine) run by a StageRunner, so caches,
commit, scorers and the frontier are ExportedBackend's, as on ONNX Runtime.

One execution context per stage, created once; every output lands in a device buffer sized from the stage's
optimization profiles and reused on every call. The target K/V stay on the device in TargetKV's buffer, appended
in place; the draft K/V one position-major buffer per layer (LayerKV). A stage whose shapes repeat round after round
(the Domino scorer stages, the frontier) is captured in a CUDA graph per shape and replayed. An input whose value
sizes an output (the block's `rows`, VALUE_DIMS) is a shape tensor: bound in host memory.
"""

import hashlib
import json

import numpy as np
import torch

from dtrt.artifacts.engine import Engine
from dtrt.artifacts.export import Export
from dtrt.artifacts.profiles import VALUE_DIMS, Profile, max_shape, select_profile
from dtrt.errors import BackendFault, DtrtError
from dtrt.runtime.backends.exported import ExportedBackend, StageRunner

TORCH_TYPES = {
    "FLOAT": torch.float32,
    "FLOAT16": torch.float16,
    "BFLOAT16": torch.bfloat16,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "BOOL": torch.bool,
}
MAX_GRAPHS = 8  # CUDA graphs kept per stage (one per distinct shape)


def graph_key(meta: dict, shapes: dict[str, tuple[int, ...]]) -> tuple | None:
    """The CUDA-graph key of a call: its shapes, for a stage whose shapes repeat (no past length P or cache
    capacity C, no prompt-sized profile, no host input); None for the others, which run eagerly."""
    if len(meta["profiles"]) > 1 or any({"P", "C"} & set(m["dims"]) for m in meta["inputs"].values()):
        return None
    if host_inputs(meta):
        return None
    return tuple(sorted((n, tuple(s)) for n, s in shapes.items()))


def host_inputs(meta: dict) -> frozenset[str]:
    """The stage's shape-tensor inputs, which TensorRT reads from host memory."""
    return frozenset(VALUE_DIMS) & meta["inputs"].keys()


def plan_buffers(meta: dict) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
    """Output -> (largest shape over the stage's profiles, or None when not known ahead, dtype)."""
    profiles = [Profile.from_json(p) for p in meta["profiles"]]
    return {
        n: (max_shape(m["dims"], profiles, meta["inputs"]), TORCH_TYPES[m["dtype"]]) for n, m in meta["outputs"].items()
    }


class Buffers:
    """One flat device tensor per output, grown when a call needs more; a call gets a view of its shape."""

    def __init__(self, plan: dict):
        self.dtypes = {n: dt for n, (_, dt) in plan.items()}
        self.flat = {
            n: torch.empty(int(np.prod(shape)) if shape is not None else 0, dtype=dt, device="cuda")
            for n, (shape, dt) in plan.items()
        }

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = int(np.prod(shape))
        if self.flat[name].numel() < numel:
            self.flat[name] = torch.empty(numel, dtype=self.dtypes[name], device="cuda")
        return self.flat[name][:numel].view(shape)


class TrtStage:
    """One plan and its execution context. Call it with device tensors by input name (-> device outputs by
    name, valid until the next call), or through `run(None, feeds)` with host arrays like an ONNX Runtime
    session."""

    def __init__(self, runtime, engine: Engine, name: str, stream: torch.cuda.Stream):
        self.name, self.meta, self.stream = name, engine.manifest["stages"][name], stream
        path = engine.plan(name)
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise DtrtError(f"{path}: TensorRT cannot deserialize it; rebuild with `{engine.rebuild_hint()}`")
        self.context = self.engine.create_execution_context()
        self.profiles = [Profile.from_json(p) for p in self.meta["profiles"]]
        self.hint = engine.rebuild_hint()
        self.buffers = Buffers(plan_buffers(self.meta))
        self.empty = torch.zeros(64, dtype=torch.uint8, device="cuda")  # address for zero-size tensors
        self.active = None
        self.graphs: dict = {}
        self.held: dict = {}

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        key = graph_key(self.meta, {n: tuple(t.shape) for n, t in feeds.items()})
        if key is not None and (key in self.graphs or len(self.graphs) < MAX_GRAPHS):
            return self._replay(key, feeds)
        outs = self._bind(feeds, self.buffers)
        self._execute()
        return outs

    def _ptr(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self.empty.data_ptr()

    def _bind(self, feeds: dict, buffers: Buffers) -> dict[str, torch.Tensor]:
        shapes = {n: tuple(t.shape) for n, t in feeds.items()}
        try:
            index = select_profile(self.profiles, shapes)
        except ValueError as e:
            raise DtrtError(
                f"stage {self.name}: {e}; rebuild with `{self.hint}` after re-exporting with a larger "
                f"--max-context or --budget"
            ) from None
        if index != self.active:
            self.context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.active = index
        for n, t in feeds.items():
            self.context.set_input_shape(n, shapes[n])
            self.context.set_tensor_address(n, self._ptr(t))  # a host input's own host address
        self.held = feeds  # host inputs are read at enqueue: kept alive until the next call
        outs = {}
        for n in self.meta["outputs"]:
            outs[n] = buffers.get(n, tuple(self.context.get_tensor_shape(n)))
            self.context.set_tensor_address(n, self._ptr(outs[n]))
        return outs

    def _execute(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise BackendFault(f"stage {self.name}: TensorRT failed to run it (see its log above)")
        torch.cuda.current_stream().wait_stream(self.stream)

    def _replay(self, key, feeds: dict) -> dict[str, torch.Tensor]:
        if key not in self.graphs:
            static = {n: t.clone() for n, t in feeds.items()}
            outs = self._bind(static, Buffers(plan_buffers(self.meta)))
            self._execute()  # TensorRT sets up on the first enqueue after a shape change, outside the capture
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self.context.execute_async_v3(self.stream.cuda_stream)
            self.graphs[key] = (graph, static, outs)
            self.active = None  # the context's bindings now belong to the graph
        graph, static, outs = self.graphs[key]
        for n, t in feeds.items():
            static[n].copy_(t)
        graph.replay()
        return outs


class TrtRunner(StageRunner):
    """One TrtStage per stage of the engine directory, on one CUDA stream."""

    name = "tensorrt"

    def __init__(self, engine: Engine, export: Export):
        import tensorrt as trt

        self.engine, self.export, self.device = engine, export, torch.device("cuda")
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.stream = torch.cuda.Stream()
        self.stages: dict[str, TrtStage] = {}

    def has(self, stage: str) -> bool:
        return stage in self.engine.manifest["stages"]

    def cost_key(self) -> dict:
        plans = json.dumps(self.engine.manifest, sort_keys=True).encode()  # the machine key and plans' sha256
        return {"runner": self.name, "engine": hashlib.sha256(plans).hexdigest()}

    def open(self, stage: str):
        if stage not in self.stages:
            if not self.has(stage):
                raise DtrtError(
                    f"{self.engine.path}: no plan for stage {stage}; rebuild with `{self.engine.rebuild_hint()}`"
                )
            self.stages[stage] = TrtStage(self.runtime, self.engine, stage, self.stream)

    def inputs(self, stage: str) -> dict[str, torch.dtype]:
        return {n: TORCH_TYPES[m["dtype"]] for n, m in self.engine.manifest["stages"][stage]["inputs"].items()}

    def host_inputs(self, stage: str) -> frozenset[str]:
        return host_inputs(self.engine.manifest["stages"][stage])

    def run(self, stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.stages[stage](**feeds)


class TrtBackend(ExportedBackend):
    @classmethod
    def over(cls, spec, sources, kind):
        return cls(sources.engine, sources.export, kind)

    def __init__(self, engine: Engine, export: Export, kind: str | None = None):
        super().__init__(TrtRunner(engine, export), kind)

"""The TensorRT backend: the plans of an engine directory (dtrt build-engine) behind OrtBackend's interface.

One execution context per stage, created once; every output lands in a device buffer sized from the stage's
optimization profiles and reused on every call. The target and draft K/V stay on the device in PackedKV's
dense layout (DevicePackedKV). A stage whose shapes repeat round after round (the Domino scorer stages, the
frontier) is captured in a CUDA graph per shape and replayed. The host tree code is shared with the ONNX
Runtime backend: it calls the scorer stages through the same `run(None, feeds)` interface.
"""

import numpy as np
import torch

from dtrt.engines.keys import probe_machine
from dtrt.engines.manifest import Engine, check_engine, read_engine, resolve_engine_dir
from dtrt.engines.profiles import Profile, max_shape, select_profile
from dtrt.errors import DtrtError
from dtrt.exporter.artifact import Export
from dtrt.models.hybrid import recurrent_parents
from dtrt.plugins import sources_sha256
from dtrt.runtime.ort_backend import SCORER_STAGES, ExportedDrafter, OrtBackend, PackedKV, drafter_dims

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
    """The CUDA-graph key of a call: its shapes, for a stage whose shapes repeat (no past length P, no
    prompt-sized profile); None for the others, which run eagerly."""
    if len(meta["profiles"]) > 1 or any("P" in m["dims"] for m in meta["inputs"].values()):
        return None
    return tuple(sorted((n, tuple(s)) for n, s in shapes.items()))


def plan_buffers(meta: dict) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
    """Output -> (largest shape over the stage's profiles, or None when not known ahead, dtype)."""
    profiles = [Profile.from_json(p) for p in meta["profiles"]]
    return {
        n: (max_shape(m["dims"], profiles, meta["inputs"]), TORCH_TYPES[m["dtype"]]) for n, m in meta["outputs"].items()
    }


def _dev(x, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)
    return t.to(device="cuda", dtype=dtype).contiguous()


class DevicePackedKV(PackedKV):
    """PackedKV in device memory. An append writes the re-spaced entries into a second buffer (one copy of
    the past and one of the new entries, for K and for V) and swaps the two."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cuda"):
        self.lead, self.rows, self.head_dim, self.capacity = (layers, heads), layers * heads, head_dim, capacity
        size = self.rows * capacity * head_dim
        self.k, self.v = (torch.zeros(size, dtype=dtype, device=device) for _ in range(2))
        self._spare = [torch.empty_like(self.k), torch.empty_like(self.v)]
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        p, n, hd = self.length, k.shape[2], self.head_dim
        q = p + n
        if q > self.capacity:
            raise RuntimeError(f"KV cache overflow: {q} > capacity {self.capacity}")
        for i, (buf, new) in enumerate(((self.k, k), (self.v, v))):
            dst = self._spare[i][: self.rows * q * hd].view(self.rows, q, hd)
            if p:
                dst[:, :p].copy_(buf[: self.rows * p * hd].view(self.rows, p, hd))
            dst[:, p:].copy_(new.reshape(self.rows, n, hd))
        (self.k, self._spare[0]), (self.v, self._spare[1]) = (self._spare[0], self.k), (self._spare[1], self.v)
        self.length = q


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

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        key = graph_key(self.meta, {n: tuple(t.shape) for n, t in feeds.items()})
        if key is not None and (key in self.graphs or len(self.graphs) < MAX_GRAPHS):
            return self._replay(key, feeds)
        outs = self._bind(feeds, self.buffers)
        self._execute()
        return outs

    def run(self, names, feeds: dict) -> list[np.ndarray]:
        types = {n: TORCH_TYPES[m["dtype"]] for n, m in self.meta["inputs"].items()}
        outs = self(**{n: _dev(x, types[n]) for n, x in feeds.items()})
        return [outs[n].cpu().numpy() for n in (names or self.meta["outputs"])]

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
            self.context.set_tensor_address(n, self._ptr(t))
        outs = {}
        for n in self.meta["outputs"]:
            outs[n] = buffers.get(n, tuple(self.context.get_tensor_shape(n)))
            self.context.set_tensor_address(n, self._ptr(outs[n]))
        return outs

    def _execute(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise DtrtError(f"stage {self.name}: TensorRT failed to run it (see its log above)")
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


class TrtBackend(OrtBackend):
    name = "tensorrt"
    kv_cache = DevicePackedKV

    def __init__(self, engine: Engine, export: Export, kind: str | None = None, threads: int | None = None):
        import tensorrt as trt

        self.engine, self.export, self.kind, self.threads = engine, export, kind, threads
        self.target_dims = export.manifest["target"]
        self.max_context = int(export.manifest["max_context"])
        self.drafter = ExportedDrafter(kind, drafter_dims(export, kind)) if kind is not None else None
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.stream = torch.cuda.Stream()
        stages = engine.manifest["stages"]
        names = ["target"] + ([f"{kind}.context", f"{kind}.block"] if kind else [])
        names += [s for s in SCORER_STAGES if kind == "domino" and s in stages]
        self.sessions = {n: TrtStage(self.runtime, engine, n, self.stream) for n in names}
        self.dtype = TORCH_TYPES[stages["target"]["inputs"]["past_k"]["dtype"]]
        self.cache: DevicePackedKV | None = None
        self.draft_cache: DevicePackedKV | None = None
        self._new_kv = None
        self.recurrent = "state" in stages["target"]["inputs"]
        self.state = self.conv = self._new_states = None

    def _target(self, ids, positions, mask, past: int):
        past_k, past_v = self.cache.view(past)
        feeds = dict(
            ids=_dev(ids, torch.long),
            positions=_dev(positions, torch.long),
            mask=_dev(mask, torch.bool),
            past_k=past_k,
            past_v=past_v,
        )
        if self.recurrent:  # as on ONNX Runtime: parents from the mask, the committed state and conv window
            parents = recurrent_parents(torch.as_tensor(mask).cpu(), self.flatten_tree)
            feeds.update(
                parents=_dev(parents, torch.long),
                state=_dev(self.state, torch.float32),
                conv=_dev(self.conv, self.dtype),
            )
        return self.sessions["target"](**feeds)

    def target_forward(self, ids, positions, mask):
        """Logits [N, V] fp32 on the host (sampling and acceptance run there) and tapped hidden states on the
        device; the new K/V stay in the stage's buffers until commit."""
        out = self._target(ids, positions, mask, self.cache.length)
        self._new_kv = (out["new_k"], out["new_v"])
        if self.recurrent:
            self._new_states = (out["states"], out["windows"])
        return out["logits"].cpu(), out["hidden"]

    def commit(self, accepted):
        idx = torch.as_tensor(accepted, dtype=torch.long).to("cuda")
        new_k, new_v = self._new_kv
        self.cache.append(new_k.index_select(2, idx), new_v.index_select(2, idx))
        self._new_kv = None
        if self.recurrent:  # the last accepted node's state already holds the whole accepted path
            states, windows = self._new_states
            self.state, self.conv = states[:, idx[-1]].clone(), windows[:, idx[-1]].clone()
            self._new_states = None

    def draft_context(self, hidden, positions):
        out = self.sessions[f"{self.kind}.context"](
            hidden=_dev(hidden, self.dtype), positions=_dev(positions, torch.long)
        )
        self.draft_cache.append(out["ctx_k"], out["ctx_v"])

    def draft_block(self, root: int, start: int):
        cache_k, cache_v = self.draft_cache.view()
        out = self.sessions[f"{self.kind}.block"](
            root=_dev([root], torch.long), start=_dev([start], torch.long), cache_k=cache_k, cache_v=cache_v
        )
        return out["ph"].cpu(), out["base"].cpu()


def open_engine(path, model: str | None = None) -> tuple[Engine, Export]:
    """The engine directory at `path` (or this machine's under the root `path`), checked against this machine,
    this dtrt's plugins and its export; returns it with the export."""
    machine = probe_machine("--backend tensorrt")
    engine = read_engine(resolve_engine_dir(path, machine, model))
    return engine, check_engine(engine, machine, sources_sha256())


def open_backend(path, model: str | None = None):
    """For `--backend tensorrt --export PATH`: (the engines' export, a TrtBackend factory over the engines)."""
    if path is None:
        raise DtrtError(
            "--backend tensorrt needs --export DIR: an engine directory written by `dtrt build-engine` "
            "(or the --out root it was given)"
        )
    engine, exp = open_engine(path, model)
    return exp, lambda export, kind, threads: TrtBackend(engine, export, kind, threads)

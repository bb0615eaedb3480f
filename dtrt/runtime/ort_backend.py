"""The ONNX Runtime backend: the stages of an export directory (dtrt export) behind TorchBackend's interface.

One CPU InferenceSession per stage, loaded once. Inputs go in as numpy arrays, which ONNX Runtime wraps without
a copy when they are contiguous; outputs come back as numpy arrays over ONNX Runtime's own buffers and are
handed to the host tree code with torch.from_numpy (no copy). IO binding, rebound on every call as the shapes
change, saves no copy on top of that on the CPU and measured slower, so plain `run` is used.

The stages take the past K/V dense, [layers, kv_heads, P, head_dim]; see PackedKV for how the caches keep
that layout without copying the past on every call.
"""

import ctypes
from dataclasses import dataclass, fields

import numpy as np
import torch

from dtrt.errors import DtrtError
from dtrt.exporter.artifact import MANIFEST, Export
from dtrt.models.hybrid import recurrent_parents
from dtrt.tree import MarginalScorer, Round, TableScorer
from dtrt.tree.scorer import greedy_chain_tables

SCORER_STAGES = ("domino.scorer_root", "domino.scorer_setup", "domino.scorer_children", "domino.scorer_advance")
NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class PackedKV:
    """K and V, [layers, kv_heads, length, head_dim] each, stored dense for the current length.

    A stage reads the cache as a view of the first layers*kv_heads*length*head_dim elements. A strided
    [.., capacity, ..] buffer would instead need a contiguous copy of the whole past on every stage call;
    here appending n entries re-spaces the (layer, head) rows in place once (one memmove per row, last row
    first so no row overwrites one not yet moved), and every call until the next append uses the same view.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype):
        self.lead, self.rows, self.head_dim, self.capacity = (layers, heads), layers * heads, head_dim, capacity
        self.k = np.zeros(self.rows * capacity * head_dim, dtype)
        self.v = np.zeros_like(self.k)
        self.length = 0

    def view(self, length: int | None = None):
        """(k, v) [layers, kv_heads, length, head_dim] views; a length beyond the stored one reads stale rows."""
        n = self.length if length is None else length
        size = self.rows * n * self.head_dim
        shape = (*self.lead, n, self.head_dim)
        return self.k[:size].reshape(shape), self.v[:size].reshape(shape)

    def append(self, k: np.ndarray, v: np.ndarray):
        """Add k, v [layers, kv_heads, n, head_dim] after the stored entries."""
        p, n, hd = self.length, k.shape[2], self.head_dim
        q = p + n
        if q > self.capacity:
            raise RuntimeError(f"KV cache overflow: {q} > capacity {self.capacity}")
        for buf, new in ((self.k, k), (self.v, v)):
            if p:
                row, base = p * hd * buf.itemsize, buf.ctypes.data
                for r in range(self.rows - 1, 0, -1):
                    ctypes.memmove(base + r * q * hd * buf.itemsize, base + r * row, row)
            buf[: self.rows * q * hd].reshape(self.rows, q, hd)[:, p:] = new.reshape(self.rows, n, hd)
        self.length = q

    def reset(self):
        self.length = 0


@dataclass(frozen=True)
class DrafterDims:
    """A drafter's entry in the export manifest: the `drafter.cfg` fields the decode loop and methods read."""

    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    k_draft: int
    mask_token_id: int
    shift_label: bool
    pure_draft_prefix_len: int
    target_layer_ids: tuple[int, ...]
    gru_dim: int | None = None
    emb_dim: int | None = None


@dataclass(frozen=True)
class ExportedDrafter:
    kind: str  # dflash | domino
    cfg: DrafterDims


def drafter_dims(exp: Export, kind: str) -> DrafterDims:
    dims = exp.drafters.get(kind)
    if dims is None:
        have = ", ".join(exp.drafters) or "none"
        raise DtrtError(
            f"{exp.path}: the export has no {kind} drafter (it has: {have}); "
            f"re-export with `{exp.fix_hint()}` and a {kind} drafter"
        )
    known = {f.name for f in fields(DrafterDims)}
    try:
        return DrafterDims(**{k: tuple(v) if k == "target_layer_ids" else v for k, v in dims.items() if k in known})
    except TypeError as e:
        raise DtrtError(
            f"{exp.path / MANIFEST}: drafters.{kind} is incomplete ({e}); re-export with `{exp.fix_hint()}`"
        ) from None


def cpu_session(path, threads: int | None = None):
    """A CPU InferenceSession configured as every dtrt stage runs (also what `dtrt parity` measures)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # idle intra-op threads would spin between stage calls, on the cores the host tree code needs
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def open_session(exp: Export, name: str, threads: int | None = None):
    path = exp.stage(name)
    try:
        sess = cpu_session(path, threads)
    except Exception as e:  # ONNX Runtime raises its own exception types for unreadable or invalid graphs
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise DtrtError(
            f"{path}: ONNX Runtime cannot load it ({e.__class__.__name__}: {first}); re-export with `{exp.fix_hint()}`"
        ) from None
    meta = exp.manifest["stages"][name]
    got = ([i.name for i in sess.get_inputs()], [o.name for o in sess.get_outputs()])
    if got != (meta["inputs"], meta["outputs"]):
        raise DtrtError(
            f"{path}: inputs/outputs {got[0]} -> {got[1]} differ from the manifest's "
            f"{meta['inputs']} -> {meta['outputs']}; re-export with `{exp.fix_hint()}`"
        )
    return sess


def _np(t, dtype) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return np.ascontiguousarray(a, dtype=dtype)


class OrtBackend:
    name = "onnxruntime"
    kv_cache = PackedKV  # the TensorRT backend keeps the same layout in device memory
    recurrent = False  # a hybrid target's stage, which also carries recurrent states and conv windows
    flatten_tree = False  # the negative control for hybrid targets (tests and benchmarks only): dtrt.models.hybrid

    def __init__(self, export: Export, kind: str | None = None, threads: int | None = None):
        self.export, self.kind, self.threads = export, kind, threads
        self.target_dims = export.manifest["target"]
        self.max_context = int(export.manifest["max_context"])
        self.drafter = ExportedDrafter(kind, drafter_dims(export, kind)) if kind is not None else None
        self.sessions = {"target": open_session(export, "target", threads)}
        if kind is not None:
            for stage in ("context", "block"):
                self.sessions[f"{kind}.{stage}"] = open_session(export, f"{kind}.{stage}", threads)
        past = next(i for i in self.sessions["target"].get_inputs() if i.name == "past_k")
        self.dtype = NUMPY_TYPES[past.type]
        self.cache: PackedKV | None = None
        self.draft_cache: PackedKV | None = None
        self._new_kv = None  # the last target forward's new K/V, until commit
        self.recurrent = "state" in {i.name for i in self.sessions["target"].get_inputs()}
        self.state = self.conv = None  # per Gated-DeltaNet layer, carried between rounds
        self._new_states = None

    @property
    def past(self) -> int:
        return self.cache.length

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def reset(self, capacity: int):
        """Fresh caches for one generation of at most `capacity` positions (prompt + output + one tree)."""
        if capacity > self.max_context:
            raise DtrtError(
                f"this generation needs up to {capacity} positions (prompt + --max-new-tokens + one "
                f"tree) but {self.export.path} was exported for {self.max_context}; shorten it or "
                f"re-export with `{self.export.fix_hint(max_context=capacity)}`"
            )
        if self.cache is None or self.cache.capacity < capacity:
            t = self.target_dims
            self.cache = self.kv_cache(
                t.get("kv_layers", t["num_layers"]), t["num_kv_heads"], t["head_dim"], capacity, self.dtype
            )
            if self.drafter is not None:
                d = self.drafter.cfg
                self.draft_cache = self.kv_cache(d.num_layers, d.num_kv_heads, d.head_dim, capacity, self.dtype)
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        self._new_kv = None
        if self.recurrent:
            t = self.target_dims
            layers = t["recurrent_layers"]
            self.state = np.zeros(
                (layers, t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]), np.float32
            )
            self.conv = np.zeros((layers, t["conv_dim"], t["linear_conv_kernel_dim"] - 1), self.dtype)

    # target stages
    def _target(self, ids, positions, mask, past: int):
        past_k, past_v = self.cache.view(past)
        feed = {
            "ids": _np(ids, np.int64),
            "positions": _np(positions, np.int64),
            "mask": _np(mask, np.bool_),
            "past_k": past_k,
            "past_v": past_v,
        }
        if self.recurrent:
            feed.update(
                parents=_np(recurrent_parents(feed["mask"], self.flatten_tree), np.int64),
                state=self.state,
                conv=self.conv,
            )
        return self.sessions["target"].run(None, feed)

    def target_forward(self, ids, positions, mask):
        """Logits [N, V] fp32 and tapped hidden states [N, taps*H]; the new K/V are kept until commit."""
        logits, hidden, new_k, new_v, *states = self._target(ids, positions, mask, self.cache.length)
        self._new_kv = (new_k, new_v)
        self._new_states = states  # hybrid: every node's recurrent states and conv windows
        return torch.from_numpy(logits), torch.from_numpy(hidden)

    def commit(self, accepted):
        """Append the accepted entries (indices into the last forward's tokens, ascending) after the past."""
        idx = _np(accepted, np.int64)
        new_k, new_v = self._new_kv
        self.cache.append(new_k[:, :, idx], new_v[:, :, idx])
        self._new_kv = None
        if self.recurrent:  # the last accepted node's state already holds the whole accepted path
            states, windows = self._new_states
            self.state, self.conv = np.ascontiguousarray(states[:, idx[-1]]), np.ascontiguousarray(windows[:, idx[-1]])
            self._new_states = None

    # drafter stages
    def draft_context(self, hidden, positions):
        ctx_k, ctx_v = self.sessions[f"{self.kind}.context"].run(
            None, {"hidden": _np(hidden, self.dtype), "positions": _np(positions, np.int64)}
        )
        self.draft_cache.append(ctx_k, ctx_v)

    def draft_block(self, root: int, start: int):
        """(ph [k_draft, H], base logits [k_draft, V] fp32) for the block rooted at `root`, position `start`."""
        cache_k, cache_v = self.draft_cache.view()
        ph, base = self.sessions[f"{self.kind}.block"].run(
            None,
            {
                "root": np.array([root], np.int64),
                "start": np.array([start], np.int64),
                "cache_k": cache_k,
                "cache_v": cache_v,
            },
        )
        return torch.from_numpy(ph), torch.from_numpy(base)

    # the scorer: marginals on the host; Domino's correction through the exported scorer stages
    def prepare_scorer(self, arm: str, topm: int):
        """Check that this export can score `arm` with `topm` candidates, and load its scorer stages."""
        if arm == "marg":
            return
        stages = self.export.manifest["stages"]
        missing = [s for s in SCORER_STAGES if s not in stages]
        if missing:
            raise DtrtError(
                f"{self.export.path}: the export has no Domino scorer stages ({', '.join(missing)}); "
                f"Domino's corrected scores need them: re-export with `{self.export.fix_hint()}` "
                f"(or use --arm marg)"
            )
        if self.kind != "domino":
            raise DtrtError(f"--arm {arm}: the Domino scorer needs the domino drafter, this backend runs {self.kind}")
        vocab = self.target_dims["vocab_size"]
        exported = self.export.manifest["topm"]
        if (min(topm, vocab) or vocab) != (min(exported, vocab) or vocab):
            raise DtrtError(
                f"--topm {topm}: the Domino scorer stages of {self.export.path} were exported with "
                f"--topm {exported}; pass --topm {exported} or re-export with "
                f"`{self.export.fix_hint(topm=topm)}`"
            )
        for name in SCORER_STAGES:
            if name not in self.sessions:
                self.sessions[name] = open_session(self.export, name, self.threads)

    def scorer(self, arm: str, rnd: Round, k: int, topm: int):
        if arm == "marg":
            return MarginalScorer(rnd, k)
        self.prepare_scorer(arm, topm)
        from dtrt.runtime.ort_scorer import OrtDominoScorer

        stages = {name.removeprefix("domino."): self.sessions[name] for name in SCORER_STAGES}
        domino = OrtDominoScorer(stages, rnd, k, self.drafter.cfg.pure_draft_prefix_len)
        return domino if arm == "dominotree" else TableScorer(domino.round, *greedy_chain_tables(domino))

    # cost probes for CaDDTree: they leave the caches as they are
    def time_verify(self, n: int, past: int):
        self._target(np.zeros(n, np.int64), np.arange(past, past + n), np.tri(n, dtype=np.bool_), past)

    def time_draft(self):
        self.draft_block(0, self.past)

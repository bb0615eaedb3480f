"""benchmarks/gpu_shapes.py: its CPU dry run, its time limits, and the Qwen3-4B shapes it builds."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_shapes.py"


@pytest.fixture
def gpu_shapes(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_shapes

    return gpu_shapes


def dry_run(tmp_path, *flags) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "shapes.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--json", str(out), *flags]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run, json.loads(out.read_text())


def positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_dry_run_measures_both_sections(tmp_path):
    """Both models, eager and static side by side, and the speedup at the stated tau, named as an input."""
    run, report = dry_run(tmp_path, "--tau", "qwen3-8b=3.5")
    secs = report["sections"]
    assert [secs[s]["status"] for s in ("build", "verify", "rounds")] == ["done"] * 3
    assert set(secs["build"]["models"]) == {"qwen3-4b", "qwen3-8b"}
    verify = secs["verify"]["rows"]
    modes = ("eager", "captured", "compiled")
    expect = {(m, mode, p, n) for m in ("qwen3-4b", "qwen3-8b") for mode in modes for p in (32, 64)
              for n in (1, 2, 4, 8)}  # fmt: skip
    assert {(r["model"], r["mode"], r["past"], r["n"]) for r in verify} == expect
    assert all(positive(r["ms"]) and positive(r["over_n1"]) and positive(r["first_ms"]) for r in verify)
    rounds = secs["rounds"]["rows"]
    keys = [(r["model"], r["mode"], r["prompt"], r["budget"], r["temperature"]) for r in rounds]
    # T=0 at every budget, then T=1 (every row drawn inside the static rounds) at the first
    cases = [(b, 0.0) for b in (4, 8)] + [(4, 1.0)]
    assert keys == [(m, mode, 32, b, t) for m in ("qwen3-4b", "qwen3-8b") for b, t in cases for mode in modes]
    for r in rounds:
        assert r["rounds"] == 6 and positive(r["tau"]) and positive(r["total_ms"]) and r["builder"] == "frontier"
        assert set(r["round_ms"]) == {"draft", "build", "verify", "commit"}
        assert all(positive(v) for v in r["round_ms"].values())
    speedups = {(s["model"], s["mode"]): s for s in report["speedups"]}
    assert set(speedups) == {(m, mode) for m in ("qwen3-4b", "qwen3-8b") for mode in modes}
    four, eight = speedups["qwen3-4b", "compiled"], speedups["qwen3-8b", "eager"]
    assert four["tau"] == 7.98 and "the paper's tau for Qwen3-4B DominoTree@16" in four["tau_is"]
    assert eight["tau"] == 3.5 and "given with --tau" in eight["tau_is"] and four["budget"] == 4
    assert math.isclose(eight["speedup"], 3.5 * eight["ar_ms"] / eight["round_ms"])
    assert "| model | mode | P | N=1 | N=2 | N=4 | N=8 |" in run.stdout
    assert "| model | mode | T | prompt | budget |" in run.stdout
    assert "at tau 7.98 (the paper's tau for Qwen3-4B DominoTree@16, an input)" in run.stdout


def test_a_failing_mode_costs_only_its_own_rows(gpu_shapes, tmp_path, monkeypatch, capsys):
    """A mode whose calls raise (a compile that breaks on a GPU, say) is recorded failed in one line, and the other
    modes are measured in full: one GPU session's run still brings back what works."""
    real = gpu_shapes.build

    def build(**kw):
        backends, info = real(**kw)

        def broken(*a, **k):
            raise RuntimeError("the compiled step broke\nsecond line")

        backends["compiled"].fused_round = broken
        return backends, info

    monkeypatch.setattr(gpu_shapes, "build", build)
    out = tmp_path / "shapes.json"
    gpu_shapes.main(["--device", "cpu", "--tiny", "--models", "qwen3-4b", "--json", str(out)])
    report = json.loads(out.read_text())
    for section in ("verify", "rounds"):
        rows = report["sections"][section]["rows"]
        assert report["sections"][section]["status"] == "done"
        errors = [r for r in rows if "error" in r]
        assert [r["mode"] for r in errors] == ["compiled"]  # once: its later calls are skipped
        assert errors[0]["error"] == "RuntimeError: the compiled step broke"
        assert {r["mode"] for r in rows if "error" not in r} == {"eager", "captured"}
    assert {s["mode"] for s in report["speedups"]} == {"eager", "captured"}
    assert "qwen3-4b, compiled failed in verify (past 32, n 1): RuntimeError" in capsys.readouterr().out


def test_no_time_left_cuts_sections_short(tmp_path):
    _, report = dry_run(tmp_path, "--budget-s", "0.001")
    statuses = [s["status"] for s in report["sections"].values()]
    assert statuses[0] == "cut short" and len(statuses) == 3
    assert all(s == "cut short" or s.startswith("skipped") for s in statuses)


def test_a_call_past_its_limit_is_interrupted(gpu_shapes):
    record, t0 = {}, time.monotonic()
    done = gpu_shapes.Budget(0.4).run("verify", lambda *, deadline: time.sleep(30), record)
    assert not done and record["status"] == "cut short" and time.monotonic() - t0 < 5


def test_no_cuda_is_one_line(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().startswith("error: --device cuda") and len(run.stderr.strip().splitlines()) == 1


def test_qwen3_4b_shapes_are_the_released_configs(gpu_shapes):
    """The values of Qwen/Qwen3-4B's config.json, z-lab/Qwen3-4B-DFlash-b16's and Huang2020/Qwen3-4B-Domino-b16's,
    read through the loaders' parsers."""
    from dtrt.models.config import default_target_layer_ids
    from dtrt.zoo.registry import MODELS

    target_json, drafter_json = gpu_shapes.configs(tiny=False)
    target, drafter, (gru, emb) = gpu_shapes.parse(target=target_json, drafter=drafter_json)
    assert (target.arch, target.hidden_size, target.intermediate_size, target.num_layers) == ("qwen3", 2560, 9728, 36)
    assert (target.num_heads, target.num_kv_heads, target.head_dim, target.vocab_size) == (32, 8, 128, 151936)
    assert target.tie_word_embeddings and target.rope_theta == 1e6 and target.qk_norm
    assert (drafter.num_layers, drafter.block_size, drafter.k_draft, drafter.mask_token_id) == (5, 16, 16, 151669)
    assert drafter.target_layer_ids == [1, 9, 17, 25, 33] == default_target_layer_ids(36, 5)
    dims = drafter.hidden_size, drafter.intermediate_size, drafter.num_heads, drafter.num_kv_heads, drafter.head_dim
    assert dims == (2560, 9728, 32, 8, 128) and drafter.rope_theta == 1e6
    assert drafter.projector_type == "domino" and drafter.shift_label and (gru, emb) == (1024, 256)
    e = MODELS["qwen3-4b"]
    assert e.target == "Qwen/Qwen3-4B" and e.dflash == "z-lab/Qwen3-4B-DFlash-b16"
    assert e.domino == "Huang2020/Qwen3-4B-Domino-b16"

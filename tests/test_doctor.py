"""dtrt doctor: what it reports for each missing piece (fake probes) and on this machine (real probes)."""

import json

from helpers import run_cli

from dtrt.engines.doctor import Check, render, run_checks

GPU = {
    "CUDA devices": lambda r: Check("CUDA devices", True, "cuda:0 NVIDIA H200 (sm 9.0)"),
    "Triton": lambda r: Check("Triton", True, "3.9.0"),
    "TensorRT": lambda r: Check("TensorRT", True, "11.4.0.106"),
    "TensorRT builder": lambda r: Check("TensorRT builder", True, "TensorRT 11.4.0.106 can build on this GPU"),
    "plugin libraries": lambda r: Check("plugin libraries", True, "dtrt TreeAttention, ..."),
}


def backends(probes):
    return {c.name: c for c in run_checks(probes)[1]}


def test_everything_present():
    b = backends(GPU)
    assert all(c.ok for c in b.values())
    assert b["torch"].detail == "cpu, cuda (the ops run their Triton kernels)"
    assert b["tensorrt"].detail == "engines from `dtrt build-engine`"


def test_each_missing_piece_names_itself():
    no_trt = {**GPU, "TensorRT": lambda r: Check("TensorRT", False, why="TensorRT is not installed (pip ...)")}
    del no_trt["TensorRT builder"], no_trt["plugin libraries"]  # the real ones, which follow from TensorRT
    checks, b = run_checks(no_trt)
    by, b = {c.name: c for c in checks}, {c.name: c for c in b}
    assert by["TensorRT builder"].why == "needs TensorRT (see above)"
    assert by["plugin libraries"].why.endswith("need TensorRT builder (see above)")
    assert "TreeGatedDeltaNet" in by["plugin libraries"].why and "dtrt v1" in by["plugin libraries"].why
    assert b["tensorrt"].why == "TensorRT: TensorRT is not installed (pip ...)"
    assert b["torch"].ok and b["onnxruntime"].ok

    no_builder = {**GPU, "TensorRT builder": lambda r: Check("TensorRT builder", False, why="CUDA init failed")}
    assert backends(no_builder)["tensorrt"].why == "TensorRT builder: CUDA init failed"
    no_triton = {**GPU, "Triton": lambda r: Check("Triton", False, why="Triton is not installed")}
    del no_triton["plugin libraries"]
    assert backends(no_triton)["tensorrt"].why.startswith("plugin libraries: the dtrt plugins")
    assert backends(no_triton)["tensorrt"].why.endswith("need Triton (see above)")
    assert backends(no_triton)["torch"].detail == (
        "cpu, cuda (the ops run their PyTorch references: Triton is not installed)"
    )
    no_ort = {"onnxruntime": lambda r: Check("onnxruntime", False, why="cannot be imported; pip install onnxruntime")}
    assert backends(no_ort)["onnxruntime"].why == "cannot be imported; pip install onnxruntime"


def test_a_broken_probe_is_a_finding():
    def broken(r):
        raise OSError("libcuda.so.1: cannot open shared object file")

    checks, b = run_checks({**GPU, "TensorRT": broken})
    trt = next(c for c in checks if c.name == "TensorRT")
    assert not trt.ok and trt.why == "the probe failed (OSError: libcuda.so.1: cannot open shared object file)"
    assert not {c.name: c for c in b}["tensorrt"].ok
    text = render(checks, b)
    assert "  --  TensorRT          the probe failed (OSError" in text
    assert text.splitlines()[-3].startswith("  ok  torch")


def test_doctor_command_on_this_machine(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "doctor")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("dtrt ") and "backends" in lines
    names = [line[6:23].strip() for line in lines[1:] if line != "backends"]
    assert names == [
        "python",
        "torch",
        "onnxruntime",
        "CPU kernel path",
        "ORT attention",
        "CUDA devices",
        "Triton",
        "TensorRT",
        "TensorRT builder",
        "plugin libraries",
        "torch",
        "onnxruntime",
        "tensorrt",
    ]
    assert all(line[2:4] in ("ok", "--") and line[23:].strip() for line in lines[1:] if line != "backends")
    path = next(line for line in lines if line[6:23].strip() == "CPU kernel path")[23:]
    assert path.split()[0] in ("amx", "avx512-vnni", "avx512", "avx2-vnni", "avx2", "sse", "unknown")
    code, out, _ = run_cli(monkeypatch, capsys, "doctor", "--json")
    report = json.loads(out)
    assert code == 0 and set(report["backends"]) == {"torch", "onnxruntime", "tensorrt"}
    trt = report["backends"]["tensorrt"]
    assert trt["ok"] or trt["why"]  # either it works here or the report says why not


def test_the_attention_kernel_says_which_path_quantized_targets_run(monkeypatch):
    from dtrt.runtime.backends import ort_ops

    monkeypatch.setattr(ort_ops, "status", lambda: "no C++ compiler (c++)")
    check = next(c for c in run_checks(GPU)[0] if c.name == "ORT attention")
    assert not check.ok and check.why == "quantized targets run the ONNX function body: no C++ compiler (c++)"
    monkeypatch.setattr(ort_ops, "status", lambda: "")
    monkeypatch.setattr(ort_ops, "library", lambda: "/cache/ort-ops/x/libdtrt_ort_ops.so")
    check = next(c for c in run_checks(GPU)[0] if c.name == "ORT attention")
    assert check.ok and check.detail == "dtrt's kernel for quantized targets (/cache/ort-ops/x/libdtrt_ort_ops.so)"

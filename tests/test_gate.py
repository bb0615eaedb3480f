"""The quality gate of the embedded default (dtrt.zoo.gate): the loop detector, the first-tokens identity, the
thresholds, the registry's refusal of a quantized default without a passing result, and the kernel-path detection
`dtrt doctor` prints."""

import pytest

from dtrt.artifacts.kernel_path import EMULATED, emulated_command, kernel_path
from dtrt.zoo import registry
from dtrt.zoo.gate import GATE, GateRecord, loops, same_start
from dtrt.zoo.registry import MODELS, ModelEntry


def test_loop_detector_on_a_looping_and_a_varied_answer():
    femme = [10, 11, 12, 13]  # "la femme, " as four tokens
    assert loops([1, 2, 3] + femme * 12)
    assert loops([5, 6] + [7] * 40)  # one token over and over
    assert not loops(list(range(200)))
    assert not loops([1, 2, 3] + femme * 12 + [99])  # the tail broke out of it
    assert not loops(femme * 8)  # 32 tokens: too short to show a 4-period over a 32-token tail
    assert loops(femme * 9)
    period_17 = list(range(17)) * 5
    assert not loops(period_17) and loops(period_17, max_period=17)


def test_same_start_compares_the_first_tokens():
    assert same_start([1, 2, 3, 9], [1, 2, 3, 8], 3) and not same_start([1, 2, 3, 9], [1, 2, 3, 8], 4)
    assert same_start([1, 2], [1, 2], 32) and not same_start([1, 2], [1, 2, 3], 32)  # one ended early


def row(**kw):
    return {"agreement": 0.995, "nll_delta": 0.001, "answers": 20, "identical": 0.95, "new_loops": 0} | kw


def test_gate_thresholds():
    assert GATE.failures(row()) == []
    assert GATE.failures(row(agreement=0.98)) == ["agreement 0.9800 < 0.99"]
    assert GATE.failures(row(nll_delta=-0.02)) == ["nll -0.0200 beyond 0.01"]
    assert GATE.failures(row(identical=0.85)) == ["identical over 32 tokens 0.85 < 0.9"]
    assert GATE.failures(row(new_loops=1)) == ["1 answers loop where the reference's do not"]
    assert GATE.failures(row(answers=0, identical=0.0, new_loops=3)) == []  # teacher-forced only


def record(config="int8", **kw):
    figures = {"agreement": 0.995, "nll_delta": 0.001, "identical": 0.95, "new_loops": 0} | kw
    return GateRecord(config, **figures, kernel_paths=("avx512-vnni",), command="dtrt quality")


def test_registry_refuses_a_quantized_default_without_a_passing_gate_result():
    with pytest.raises(ValueError, match="default target int8 has no recorded quality gate result"):
        ModelEntry("m", quant="int8")
    with pytest.raises(ValueError, match="default target int8 does not pass the quality gate"):
        ModelEntry("m", quant="int8", gate=record(agreement=0.96))
    with pytest.raises(ValueError, match="its gate result is for int4, its default target is int8"):
        ModelEntry("m", quant="int8", gate=record("int4"))
    assert ModelEntry("m", quant="int8", gate=record()).gate.passed
    assert ModelEntry("m").gate is None  # an fp32 default is the reference's own configuration


def test_the_embedded_default_passes_its_recorded_gate():
    entry = MODELS[registry.DEFAULT_MODEL]
    assert entry.gate is not None and entry.gate.config == entry.quant and entry.gate.passed
    assert entry.gate.kernel_paths  # MLAS's paths it was measured on (docs/quantization.md: why gguf has one)


def test_kernel_path_follows_the_cpu_flags():
    avx2 = {"avx", "avx2", "fma", "sse4_2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
    assert kernel_path(set()) == "sse" and kernel_path(avx2) == "avx2"
    assert kernel_path(avx2 | {"avx_vnni"}) == "avx2-vnni"
    assert kernel_path(avx512) == "avx512" and kernel_path(avx512 | {"avx512_vnni"}) == "avx512-vnni"
    assert kernel_path(avx512 | {"avx512_vnni", "amx_tile", "amx_int8"}) == "amx"


def test_emulated_command_names_what_is_missing(monkeypatch):
    import shutil

    with pytest.raises(ValueError, match="emulated kernel paths are avx2"):
        emulated_command("avx512", ["-c", "pass"])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="qemu-x86_64 not found: apt-get install qemu-user"):
        emulated_command("avx2", ["-c", "pass"])
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    command, env = emulated_command("avx2", ["-m", "x"])
    assert command[:3] == ["/usr/bin/qemu-x86_64", "-cpu", EMULATED["avx2"]] and command[-2:] == ["-m", "x"]
    assert "PYTHONPATH" in env

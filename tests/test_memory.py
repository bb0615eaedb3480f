"""The first-use ONNX Runtime export of a registry model is refused, with the numbers and what fits, when this
machine cannot hold it."""

import pytest
from helpers import run_cli

from dtrt.errors import DtrtError
from dtrt.launch import memory
from dtrt.models.pair import Pair
from dtrt.models.quant_spec import quant_spec

GB = 1e9


def test_need_of_the_tiny_pair(tiny):
    export, run, target = memory.need(tiny)
    assert target == memory.parameters(tiny.target) > 0
    drafters = memory.parameters(tiny.dflash) + memory.parameters(tiny.domino)
    assert export == int(memory.EXPORT_PEAK * 4 * (target + drafters) + memory.EXPORT_FIXED)
    assert run == int(1.2 * 4 * (target + drafters) + memory.RUNTIME)
    embedding = memory.embedding_parameters(tiny.target)
    assert 0 < embedding < target
    _, run8, _ = memory.need(tiny, "fp16", quant_spec("int8"))
    assert run8 == int(2.2 * (target + 2 * (embedding + drafters)) + memory.RUNTIME) < run
    memory.check_first_use(tiny, "tiny", free=int(100 * GB))  # fits
    with pytest.raises(DtrtError, match=r"^--model tiny on ONNX Runtime: its first-use fp32 export needs about"):
        memory.check_first_use(tiny, "tiny", free=int(0.1 * GB))


@pytest.fixture
def qwen3_4b(monkeypatch):
    params = {"target": 4_022_468_096, "dflash": 500_000_000, "domino": 510_000_000}
    monkeypatch.setattr(memory, "parameters", lambda path: params[str(path)])
    monkeypatch.setattr(memory, "embedding_parameters", lambda path: 151936 * 2560)
    return Pair("target", "dflash", "domino")


def test_qwen3_4b_is_refused_on_24_gb_and_told_what_fits(qwen3_4b):
    export, run, _ = memory.need(qwen3_4b)
    assert 25 * GB < export < 27 * GB and 24 * GB < run < 25 * GB
    with pytest.raises(DtrtError) as e:
        memory.check_first_use(qwen3_4b, "qwen3-4b", free=int(22.8 * GB))
    msg = str(e.value)
    assert "needs about 26.2 GB while exporting and 24.7 GB to run (4.02 B target parameters)" in msg, msg
    assert "22.8 GB available" in msg and "--backend torch --device cuda --dtype bf16" in msg and "\n" not in msg
    # on the CPU: the fp16 export of an int8 target, which the scale check ran on 24 GB
    assert "an fp16 export of an int8 target (about 13.6 GB while exporting, 15.5 GB to run)" in msg, msg
    assert "dtrt export --model qwen3-4b --dtype fp16 --quant int8 --out DIR" in msg


def test_the_quantized_first_use_is_judged_by_its_own_need(qwen3_4b):
    """`--quant int8` on the zero-config path: its fp32 export still needs the fp32 weights' memory, and where only
    int4 fits, the CPU alternative names int4; where nothing fits, the torch backend."""
    with pytest.raises(DtrtError, match="first-use fp32 export with an int8 target needs about 26.2 GB"):
        memory.check_first_use(qwen3_4b, "qwen3-4b", quant="int8", free=int(22.8 * GB))
    _, run8, _ = memory.need(qwen3_4b, "fp16", quant_spec("int8"))
    export4, run4, _ = memory.need(qwen3_4b, "fp16", quant_spec("int4"))
    assert run4 < run8 and export4 < run8
    with pytest.raises(DtrtError, match="an int4 target"):
        memory.check_first_use(qwen3_4b, "qwen3-4b", free=int(max(export4, run4) + 1))
    with pytest.raises(DtrtError, match="on this CPU with --backend torch --dtype bf16$"):
        memory.check_first_use(qwen3_4b, "qwen3-4b", free=int(5 * GB))


def test_the_zero_config_path_refuses_before_exporting(tiny, tmp_path, monkeypatch, capsys):
    from dtrt.launch import first_use

    monkeypatch.setattr(first_use, "cache_dir", lambda: tmp_path)  # no cached export yet
    monkeypatch.setattr(memory, "available", lambda: int(0.05 * GB))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--backend", "onnxruntime", "x")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --model tiny on ONNX Runtime: its first-use fp32 export needs about")
    assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").iterdir())


def test_export_jobs_take_a_second_core_where_the_target_fits_twice(tiny):
    assert memory.export_jobs(tiny, free=int(100 * GB), cores=2) == 2
    assert memory.export_jobs(tiny, free=int(100 * GB), cores=1) == 1  # no core to spare
    assert memory.export_jobs(tiny, free=int(0.1 * GB), cores=8) == 1
    assert memory.export_jobs(tiny, "bf16", free=int(100 * GB), cores=2) == 2  # an export for TensorRT too


def test_export_jobs_count_the_second_copy_of_the_target(qwen3_4b):
    export, _, target = memory.need(qwen3_4b, "fp16")
    second = memory.EXPORT_PEAK * target * 2 + memory.EXPORT_FIXED  # the second process's own copy of the target
    assert memory.export_jobs(qwen3_4b, "fp16", free=int(export + second), cores=2) == 2
    assert memory.export_jobs(qwen3_4b, "fp16", free=int(export + second) - 1, cores=2) == 1

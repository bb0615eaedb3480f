"""The first-use ONNX Runtime export of a registry model is refused, with the numbers and what fits, when this
machine cannot hold it."""

import pytest
from helpers import run_cli

from dtrt.errors import DtrtError
from dtrt.launch import memory
from dtrt.models.checkpoint import Pair

GB = 1e9


def test_need_of_the_tiny_pair(tiny):
    export, run, target = memory.first_use_need(tiny)
    assert target == memory.parameters(tiny.target) > 0
    drafters = memory.parameters(tiny.dflash) + memory.parameters(tiny.domino)
    assert export == int(memory.EXPORT_PEAK * 4 * (target + drafters) + memory.RUNTIME)
    assert run == int(1.2 * 4 * target + 4 * drafters + memory.RUNTIME)
    memory.check_first_use(tiny, "tiny", free=int(100 * GB))  # fits
    with pytest.raises(DtrtError, match=r"^--model tiny on ONNX Runtime: its first-use fp32 export needs about"):
        memory.check_first_use(tiny, "tiny", free=int(0.1 * GB))


def test_qwen3_4b_is_refused_on_24_gb(monkeypatch):
    params = {"target": 4_022_468_096, "dflash": 500_000_000, "domino": 510_000_000}
    monkeypatch.setattr(memory, "parameters", lambda path: params[str(path)])
    pair = Pair("target", "dflash", "domino")
    export, run, _ = memory.first_use_need(pair)
    assert 40 * GB < export < 50 * GB and 20 * GB < run < 25 * GB
    with pytest.raises(DtrtError) as e:
        memory.check_first_use(pair, "qwen3-4b", free=int(22.8 * GB))
    msg = str(e.value)
    assert "needs about 48.8 GB while exporting and 23.8 GB to run (4.02 B target parameters)" in msg, msg
    assert "22.8 GB available" in msg and "--backend torch --device cuda --dtype bf16" in msg and "\n" not in msg


def test_the_zero_config_path_refuses_before_exporting(tiny, tmp_path, monkeypatch, capsys):
    from dtrt.launch import first_use

    monkeypatch.setattr(first_use, "cache_dir", lambda: tmp_path)  # no cached export yet
    monkeypatch.setattr(memory, "available", lambda: int(0.05 * GB))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--backend", "onnxruntime", "x")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --model tiny on ONNX Runtime: its first-use fp32 export needs about")
    assert not (tmp_path / "exports").exists() or not any((tmp_path / "exports").iterdir())

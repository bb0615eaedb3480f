"""Export precisions: a bf16 export (for TensorRT) and what refuses it, and the fp16 overflow check of a checkpoint
stored in bf16."""

import json
import shutil

import onnx
import pytest
import torch
from helpers import pipe_for, run_cli, spec
from test_engines import fake_trt  # noqa: F401 (fixture)

from dtrt.engines.build import build_engines
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.precision import fp16_warning, stored_dtype
from dtrt.exporter.write import export_pair
from dtrt.models.checkpoint import load_target, save_checkpoint, target_state
from dtrt.models.pair import Pair
from dtrt.parity import run_parity
from dtrt.runtime.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def bf16_export(tiny, tmp_path_factory):
    return export_pair(
        tiny, tmp_path_factory.mktemp("bf16") / "tiny", ExportConfig(dtype="bf16", max_context=256), model="tiny"
    )


@pytest.mark.slow
def test_bf16_export_holds_bf16_graphs(bf16_export):
    assert bf16_export.manifest["dtype"] == "bf16" and "--dtype bf16" in bf16_export.fix_hint()
    graph = onnx.load(str(bf16_export.stage("target")), load_external_data=False).graph
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    assert types["past_k"] == onnx.TensorProto.BFLOAT16 and types["ids"] == onnx.TensorProto.INT64
    weights = [i for i in graph.initializer if len(i.dims) == 2]
    assert weights and all(i.data_type == onnx.TensorProto.BFLOAT16 for i in weights)


@pytest.mark.slow
def test_onnxruntime_and_parity_refuse_bf16_in_one_line(bf16_export, monkeypatch, capsys):
    with pytest.raises(DtrtError, match=r"holds bf16 graphs, which ONNX Runtime's CPU provider cannot run") as e:
        pipe_for(None, spec("dominotree"), backend="onnxruntime", export=bf16_export.path)
    assert "dtrt build-engine" in str(e.value) and "--dtype fp32" in str(e.value) and "\n" not in str(e.value)
    code, out, err = run_cli(monkeypatch, capsys, "run", "--export", str(bf16_export.path), "x")
    assert code == 2 and out == "" and err.count("\n") == 1 and "holds bf16 graphs" in err
    with pytest.raises(DtrtError, match=r"dtrt parity runs the stages on ONNX Runtime's CPU provider"):
        run_parity(bf16_export, prompts=0)


@pytest.mark.slow
def test_build_engine_takes_a_bf16_export(bf16_export, tmp_path, fake_trt):  # noqa: F811
    eng = build_engines(bf16_export.path, tmp_path / "engines")
    target = eng.manifest["stages"]["target"]
    assert target["inputs"]["past_k"]["dtype"] == "BFLOAT16" and target["outputs"]["logits"]["dtype"] == "FLOAT"


def bf16_copy(tiny, path, scale: float = 1.0):
    """The tiny target stored in bf16 (as released Qwen3 checkpoints are), one MLP weight scaled by `scale`."""
    shutil.copytree(tiny.target, path)
    target = load_target(tiny.target)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(scale)
    cfg = json.loads((path / "config.json").read_text()) | {"torch_dtype": "bfloat16"}
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_checkpoint(path, cfg, {k: v.to(torch.bfloat16) for k, v in target_state(target).items()})
    return path


def test_fp16_overflow_of_a_bf16_checkpoint_is_warned(tiny, tmp_path):
    calm, hot = bf16_copy(tiny, tmp_path / "calm"), bf16_copy(tiny, tmp_path / "hot", scale=3e5)
    assert stored_dtype(calm) == "bf16" and stored_dtype(tiny.target) == "fp32"
    tokenizer = load_tokenizer(tiny.target)
    assert fp16_warning(calm, load_target(calm, torch.float16), tokenizer) is None
    warning = fp16_warning(hot, load_target(hot, torch.float16), tokenizer)
    assert warning.startswith(f"warning: {hot} is stored in bf16, and in fp16 its activations ")
    assert "decoder layer 1" in warning and "--dtype bf16" in warning and "\n" not in warning
    logs = []
    export_pair(Pair(hot), tmp_path / "exp", ExportConfig(dtype="fp16", max_context=64), log=logs.append)
    assert warning in logs  # the export still completes: the output of an fp16 target is the user's call

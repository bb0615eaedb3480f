"""TensorRT end to end on the tiny export (marked `trt`: needs TensorRT, Triton and a CUDA GPU): dtrt
build-engine writes a complete engine directory for this machine, every stage's plan matches ONNX Runtime on
the same inputs, and every method on the TensorRT backend gives exactly the torch backend's (= AR) tokens with
drafts accepted."""

import json

import numpy as np
import pytest
import torch
from helpers import pipe_for, run_cli
from test_ort_backend import DOMINO_VARIANTS, VARIANTS, check_speculative, ids

from dtrt.artifacts.engine import check_engine, read_engine
from dtrt.artifacts.gpu import probe_machine
from dtrt.engines.build import build_engines
from dtrt.errors import DtrtError
from dtrt.exporter.stage_modules import random_tree_mask
from dtrt.plugins import sources_sha256
from dtrt.runtime.backends.onnxruntime import OrtRunner
from dtrt.runtime.backends.tensorrt import TrtRunner

pytestmark = pytest.mark.trt


@pytest.fixture(scope="module")
def engine(tiny_export, tmp_path_factory):
    return build_engines(tiny_export.path, tmp_path_factory.mktemp("engines"))


def test_build_engine_command(tiny_export, tmp_path, monkeypatch, capsys):
    machine = probe_machine("test")
    code, out, err = run_cli(monkeypatch, capsys, "build-engine", str(tiny_export.path), "--out", str(tmp_path))
    assert code == 0, err
    path = tmp_path / machine.key / "tiny"
    assert out.startswith(f"{path}: {len(tiny_export.manifest['stages'])} plans")
    eng = read_engine(path)
    assert eng.manifest["machine"] == machine.to_json() and (path / "timing.cache").stat().st_size > 0
    assert check_engine(eng, machine, sources_sha256()).path == tiny_export.path
    code, _, err = run_cli(monkeypatch, capsys, "build-engine", str(tiny_export.path), "--out", str(tmp_path))
    assert code == 2 and "pass --force" in err


def feeds(meta: dict, n: int, p: int, vocab: int, k_draft: int, gen: torch.Generator) -> dict:
    """Valid random inputs for a stage: n new tokens (or nodes, or requests, or up to k_draft drafter rows) over a
    past of p."""
    rows = min(n, k_draft)
    sizes = {"N": n, "P": p, "bs": n, "R": rows}
    out = {}
    for name, m in meta["inputs"].items():
        shape = [sizes[d] if isinstance(d, str) else d for d in m["dims"]]
        if name == "rows":
            out[name] = np.array([rows])
        elif name == "mask":
            out[name] = random_tree_mask(n, gen)[1].numpy()
        elif name == "positions":
            out[name] = np.arange(p, p + shape[0])
        elif name == "start":
            out[name] = np.array([p])
        elif m["dtype"] == "INT64":
            out[name] = torch.randint(0, vocab, shape, generator=gen).numpy()
        else:
            out[name] = torch.randn(shape, generator=gen).numpy().astype(np.float32)
    return out


def test_every_stage_matches_onnxruntime(engine, tiny_export):
    trt_runner, ort_runner = TrtRunner(engine, tiny_export), OrtRunner(tiny_export)
    vocab = tiny_export.manifest["target"]["vocab_size"]
    k_draft = tiny_export.manifest["drafters"]["domino"]["k_draft"]
    gen = torch.Generator().manual_seed(0)
    for name, meta in engine.manifest["stages"].items():
        trt_runner.open(name)
        ort_runner.open(name)
        for n, p in ((1, 0), (9, 7), (17, 100)):
            x = feeds(meta, n, p, vocab, k_draft, gen)
            got_all, want_all = trt_runner(name, **x), ort_runner(name, **x)
            for out in meta["outputs"]:
                got, want = got_all[out].cpu().numpy(), want_all[out].numpy()
                assert got.shape == want.shape, (name, out)
                if got.dtype.kind == "f":
                    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{name}.{out}")
                else:
                    assert np.array_equal(got, want), (name, out)


@pytest.mark.parametrize("draft", VARIANTS + DOMINO_VARIANTS, ids=ids)
def test_tensorrt_gives_the_torch_tokens(engine, draft, torch_tokens):
    pipe = pipe_for(None, draft, backend="tensorrt", engines=engine.root)
    check_speculative(pipe, draft, torch_tokens)


def test_engine_of_another_machine_is_refused(engine, tmp_path):
    manifest = json.loads((engine.path / "manifest.json").read_text())
    manifest["machine"]["gpu_name"] = "NVIDIA GeForce RTX 5080"
    other = tmp_path / engine.path.name
    other.mkdir()
    for f in engine.path.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DtrtError, match="gpu_name 'NVIDIA GeForce RTX 5080' differs from this machine's"):
        pipe_for(None, VARIANTS[0], backend="tensorrt", engines=other)

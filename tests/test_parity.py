"""`dtrt parity`: every exported stage of the tiny pair matches its PyTorch reference, and a corrupted graph, a
perturbed reference or a modified checkpoint is caught."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from helpers import run_cli

from dtrt.artifacts.files import write_manifest
from dtrt.exporter.reference import reference_stages
from dtrt.parity.check import NS, PS, TOLERANCES, compare, run_parity


@pytest.fixture(scope="module")
def report(tiny_export):
    return run_parity(tiny_export, prompts=3)


def test_every_stage_matches_on_the_grid_and_on_real_inputs(tiny_export, report):
    assert tiny_export.manifest["dtype"] == "fp32" and report.tol == TOLERANCES["fp32"]
    assert report.ok, report.table()
    manifest = tiny_export.manifest["stages"]
    assert list(dict.fromkeys(r.stage for r in report.rows)) == list(manifest)
    grid = {f"N={n} P={p}" for n in NS for p in PS}
    # a block's N: the rows it is asked for, up to k_draft
    expected = {"target": grid, **{f"{k}.{s}": grid for k in ("dflash", "domino") for s in ("context", "block")}}
    for name, meta in manifest.items():
        rows = [r for r in report.rows if r.stage == name]
        cases = {r.case for r in rows}
        random = {c for c in cases if not c.startswith("real")}
        assert (random == expected[name]) if name in expected else len(random) >= 3, name
        real = [r for r in rows if r.case.startswith("real")]
        assert [r.output for r in real] == meta["outputs"] and real[0].calls >= 6, name
        for case in cases:
            assert [r.output for r in rows if r.case == case] == meta["outputs"]
    for r in report.rows:
        assert r.cosine >= 0.99999 and r.rel <= 1e-4
        if r.output in ("logits", "base"):
            assert r.agree == r.rows > 0
    # the real target inputs include prefills and tree verifies over a growing past
    real_target = next(r for r in report.rows if r.stage == "target" and r.case.startswith("real"))
    assert "P 0-" in real_target.case


def test_cli_prints_the_table(tiny_export, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "parity", str(tiny_export.path), "--prompts", "1")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[1].split() == ["stage", "case", "output", "cosine", "max", "abs", "rel", "argmax", "result"]
    assert lines[-1] == "all stages pass"
    body = [line.split() for line in lines[2:-1]]
    assert {b[0] for b in body} == set(tiny_export.manifest["stages"])
    assert all(b[-1] == "ok" for b in body)
    assert any(b[:4] == ["target", "N=33", "P=100", "logits"] and b[-2] == "33/33" for b in body)
    assert any(b[0] == "domino.block" and b[1] == "real" for b in body)


def test_compare_rules():
    tol = TOLERANCES["fp32"]

    def ok(name, ref, out):
        return compare("s", "c", name, np.asarray(ref), np.asarray(out), tol).ok

    x = np.linspace(-3, 3, 64, dtype=np.float32)
    assert ok("h", x, x + 1e-5) and not ok("h", x, x + 3e-3) and not ok("h", x, -x)
    assert not ok("h", x, x[None])  # shape
    assert not ok("h", x, x.astype(np.float16))  # dtype
    assert ok("t", np.arange(5), np.arange(5)) and not ok("t", np.arange(5), np.arange(5)[::-1])
    assert not ok("m", np.eye(3, dtype=bool), np.ones((3, 3), bool))
    inf = np.float32(-np.inf)
    assert ok("s", [1.0, inf], [1.0, inf]) and not ok("s", [1.0, inf], [inf, 1.0])
    assert not ok("h", [1.0, np.nan], [1.0, np.nan])
    # an argmax flip between near-tied logits is reported, and within tolerance
    row = compare(
        "s",
        "c",
        "logits",
        np.float32([[2.0, 2.0 - 1e-7, 0.0], [0, 1, 2]]),
        np.float32([[2.0 - 1e-7, 2.0, 0.0], [0, 1, 2]]),
        tol,
    )
    assert row.ok and (row.agree, row.rows) == (1, 2)


def _corrupt_weight(onnx_path, suffix):
    """Add 1 to the first element of the external-data initializer named *suffix, in place."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name.endswith(suffix))
    info = {e.key: e.value for e in init.external_data}
    with open(onnx_path.parent / info["location"], "r+b") as f:
        f.seek(int(info.get("offset", 0)))
        value = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(int(info.get("offset", 0)))
        f.write(np.float32(value + 1).tobytes())


def test_corrupted_onnx_weight_fails_that_stage(tiny_export, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "export"
    shutil.copytree(tiny_export.path, copy)
    _corrupt_weight(copy / "target.onnx", "layers.0.mlp.down_proj.weight")
    write_manifest(copy, json.loads((copy / "manifest.json").read_text()))  # as if exported wrong: hashes agree
    code, out, err = run_cli(monkeypatch, capsys, "parity", str(copy), "--random-only", "--json")
    assert code == 1
    result = json.loads(out)
    assert result["ok"] is False and result["failed"] == ["target"]
    assert result["stages"] == {name: name != "target" for name in tiny_export.manifest["stages"]}
    assert err.strip().splitlines()[-1] == "parity failed: target"


def test_perturbed_reference_fails_only_its_stage(tiny_export):
    stages = reference_stages(tiny_export)
    drafter = stages["domino.block"].module.drafter
    assert stages["domino.context"].module.drafter is drafter
    down = drafter.layers[0].mlp.down_proj.weight
    with torch.no_grad():  # the block runs the MLP, the context stage only the K/V projections
        down[0, 0] += 0.5  # one weight: caught in the hidden rows (rel ~1e-3; the logits behind the lm_head move less)
    report = run_parity(tiny_export, prompts=0, stages={k: stages[k] for k in ("domino.context", "domino.block")})
    assert report.failed == ["domino.block"]
    assert "ph" in {r.output for r in report.rows if not r.ok}
    with torch.no_grad():
        down[0] += 0.5  # one row: caught in both outputs
    report = run_parity(tiny_export, prompts=0, stages={k: stages[k] for k in ("domino.context", "domino.block")})
    assert report.failed == ["domino.block"]
    assert {r.output for r in report.rows if not r.ok} == {"ph", "base"}


@pytest.mark.parametrize("which", ["target", "domino", "missing"])
def test_modified_checkpoint_is_one_line_error(tiny, tiny_export, tmp_path, monkeypatch, capsys, which):
    copy = tmp_path / "export"
    shutil.copytree(tiny_export.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    src = manifest["source"]
    if which == "missing":
        src["target"] = str(tmp_path / "gone")
    else:
        ckpt = shutil.copytree(tiny.target if which == "target" else tiny.domino, tmp_path / which)
        with open(ckpt / "model.safetensors", "r+b") as f:  # same size, one byte of the last tensor changed
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
        if which == "target":
            src["target"] = str(ckpt)
        else:
            src["drafters"]["domino"]["path"] = str(ckpt)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(monkeypatch, capsys, "parity", str(copy))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    expected = {
        "target": "exported from another target checkpoint",
        "domino": "exported from another domino drafter checkpoint",
        "missing": "is not found",
    }[which]
    assert err.startswith("error: ") and expected in err and "dtrt export --model tiny" in err


def test_bad_export_dir_is_one_line_error(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "parity", str(tmp_path / "none"))
    assert code == 2 and out == "" and err.startswith("error: ") and "export directory not found" in err
    assert len(err.strip().splitlines()) == 1


def test_quick_parity_is_one_case_per_stage(tiny_export):
    from dtrt.parity.check import random_cases

    stages = reference_stages(tiny_export)
    for name, stage in stages.items():
        assert len(random_cases(stage, quick=True)) == 1, name
    target = random_cases(stages["target"], quick=True)[0][0]
    assert target == "N=9 P=7"
    report = run_parity(tiny_export, prompts=0, quick=True, stages={"target": stages["target"]})
    assert report.ok and {r.case for r in report.rows} == {"N=9 P=7"}


def test_the_torch_stage_runner_decodes_as_onnx_runtime_does(tiny_export):
    """The PyTorch reference stages behind the same backend as the export: the same DominoTree tokens as ONNX
    Runtime gives, AR's tokens, with drafts accepted (one stage contract, three runners)."""
    from dataclasses import replace

    from dtrt.exporter.reference import TorchStageRunner
    from dtrt.runtime.backends.exported import ExportedBackend
    from dtrt.runtime.methods import make_method
    from dtrt.runtime.pipeline import Pipeline
    from tests.helpers import generate_all, pipe_for, spec

    ort = pipe_for(None, spec("dominotree", budget=4), backend="onnxruntime", export=tiny_export.path, threads=1)
    ar = pipe_for(None, spec("ar"), backend="onnxruntime", export=tiny_export.path, threads=1)
    backend = ExportedBackend(TorchStageRunner(tiny_export), "domino")
    backend.prepare(ort.spec)
    ref = replace(ort, backend=backend, method=make_method(ort.spec))
    assert isinstance(ref, Pipeline) and backend.name == "torch"
    want = [g.tokens for g in generate_all(ar, max_new=24)]
    gens = generate_all(ref, max_new=24)
    assert [g.tokens for g in gens] == want == [g.tokens for g in generate_all(ort, max_new=24)]
    assert sum(r.accepted - 1 for g in gens for r in g.rounds) > 0


def tied_base(shape) -> torch.Tensor:
    """Base logits of `shape` [..., V] whose rows tie: every id (rows 0, 3, ...), ids over 4 values (rows 1, 4, ...:
    ties across the M candidates), 10 finite ids and -inf after them (rows 2, 5, ...: fewer than M, as outside a
    draft vocabulary)."""
    vocab = shape[-1]
    base = torch.zeros(shape).reshape(-1, vocab)
    base[1::3] = torch.randint(0, 4, base[1::3].shape, generator=torch.Generator().manual_seed(0)).float()
    base[2::3, 10:] = float("-inf")
    base[2::3, :10] = torch.arange(10.0).flip(0)
    return base.reshape(shape)


@pytest.mark.parametrize("stage", ["domino.scorer_setup", "domino.chain", "domino.frontier"])
def test_stages_on_tied_base_logits_break_ties_by_the_lower_token_id(tiny_export, stage):
    """Exactly tied base logits (a quantized lm_head's): the graph's TopK and the PyTorch reference both take the
    higher value first and, among equal values, the lower token id, so the candidates, the drafts and the trees are
    equal and strict parity passes, whatever order a CPU's top-k kernel would leave ties in."""
    from dtrt.exporter.reference import TorchStageRunner
    from dtrt.parity.check import compare_stage, random_cases
    from dtrt.runtime.backends.onnxruntime import OrtRunner

    reference, ort = TorchStageRunner(tiny_export), OrtRunner(tiny_export)
    _, feed = random_cases(reference.stage(stage), True)[0]
    feed = dict(feed, base=tied_base(feed["base"].shape))
    checked = compare_stage(stage, ort, reference, [("tied", feed)], TOLERANCES["fp32"])
    assert checked and all(r.ok and not r.tied for r in checked), checked
    if stage == "domino.scorer_setup":
        cand = ort(stage, **feed)["cand"]
        for row, ids in zip(feed["base"].tolist(), cand.tolist()):
            assert ids == sorted(range(len(row)), key=lambda i: (-row[i], i))[: len(ids)]

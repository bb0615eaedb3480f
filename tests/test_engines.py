"""dtrt build-engine and the engine directory, everything that runs without TensorRT: optimization profiles,
engine keys, the manifest and its checks, atomic output, the TensorRT backend's pure parts."""

import json
from pathlib import Path

import onnx
import pytest
import torch
from helpers import pipe_for, run_cli, spec

from dtrt import __version__
from dtrt.artifacts.engine import check_engine, read_engine, resolve_engine_dir
from dtrt.artifacts.export import FORMAT, load_export
from dtrt.artifacts.files import MANIFEST, sha256
from dtrt.artifacts.gpu import LABELS, Machine, engine_dir, tensorrt_status
from dtrt.artifacts.profiles import select_profile
from dtrt.engines import build
from dtrt.engines.build import BuildConfig, build_engines, plan_stages
from dtrt.engines.profile_bounds import Limits, stage_profiles
from dtrt.errors import DtrtError
from dtrt.plugins import sources_sha256
from dtrt.plugins.ptx import strip_hidden_params
from dtrt.runtime.backends.tensorrt import graph_key, host_inputs, plan_buffers

H200 = Machine("NVIDIA H200", "9.0", "11.4.0.106", "12.8")
# the stage signatures of the tiny pair's export (dtrt export --model tiny --max-context 512)
STAGES = {
    "target": (
        {
            "ids": ("INT64", ["N"]),
            "positions": ("INT64", ["N"]),
            "mask": ("BOOL", ["N", "N"]),
            "past_k": ("FLOAT", [4, 2, "C", 24]),
            "past_v": ("FLOAT", [4, 2, "C", 24]),
            "past_positions": ("INT64", ["P"]),
        },
        {
            "logits": ("FLOAT", ["N", 128]),
            "hidden": ("FLOAT", ["N", 192]),
            "new_k": ("FLOAT", [4, 2, "N", 24]),
            "new_v": ("FLOAT", [4, 2, "N", 24]),
        },
    ),
    "domino.context": (
        {"hidden": ("FLOAT", ["N", 192]), "positions": ("INT64", ["N"])},
        {"ctx_k": ("FLOAT", [1, 2, "N", 24]), "ctx_v": ("FLOAT", [1, 2, "N", 24])},
    ),
    "domino.block": (
        {
            "root": ("INT64", [1]),
            "start": ("INT64", [1]),
            "rows": ("INT64", [1]),
            "cache_k0": ("FLOAT", ["P", 2, 24]),
            "cache_v0": ("FLOAT", ["P", 2, 24]),
        },
        {"ph": ("FLOAT", ["R", 96]), "base": ("FLOAT", ["R", 128])},
    ),
    "domino.scorer_setup": (
        {"ph": ("FLOAT", ["R", 96]), "base": ("FLOAT", ["R", 128])},
        {"cand": ("INT64", ["R", 64]), "zproj": ("FLOAT", ["R", 32])},
    ),
    "domino.scorer_children": (
        {
            "zproj": ("FLOAT", [32]),
            "states": ("FLOAT", ["N", 32]),
            "basec": ("FLOAT", [64]),
            "w2c": ("FLOAT", [64, 32]),
        },
        {"logprobs": ("FLOAT", ["N", 64])},
    ),
    "domino.frontier": (
        {"ph": ("FLOAT", ["bs", 8, 96]), "base": ("FLOAT", ["bs", 8, 128]), "root": ("INT64", ["bs"])},
        {"tokens": ("INT64", ["bs", 17]), "mask": ("BOOL", ["bs", 17, 17])},
    ),
}


def write_export(path: Path, budget=16, model="tiny") -> Path:
    """An export directory with the tiny export's stage signatures (graphs without nodes: only their inputs and
    outputs are read here) and a complete manifest."""
    path.mkdir(parents=True)

    def values(sig):
        return [
            onnx.helper.make_tensor_value_info(n, getattr(onnx.TensorProto, t), dims) for n, (t, dims) in sig.items()
        ]

    for name, (inputs, outputs) in STAGES.items():
        graph = onnx.helper.make_graph([], name, values(inputs), values(outputs))
        onnx.save(onnx.helper.make_model(graph), str(path / f"{name}.onnx"))
    manifest = {
        "format": FORMAT,
        "dtrt_version": __version__,
        "dtype": "fp32",
        "max_context": 512,
        "budget": budget,
        "topm": 64,
        "node_topk": 8,
        "source": {"model": model},
        "drafters": {"domino": {"k_draft": 8, "block_size": 8}},
        "stages": {n: {"file": f"{n}.onnx", "inputs": list(i), "outputs": list(o)} for n, (i, o) in STAGES.items()},
        "files": {f.name: {"size": f.stat().st_size, "sha256": sha256(f)} for f in sorted(path.iterdir())},
    }
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


@pytest.fixture
def export_dir(tmp_path):
    return write_export(tmp_path / "exports" / "tiny")


@pytest.fixture
def fake_trt(monkeypatch):
    """build-engine on an H200 whose TensorRT writes each plan as the stage's name: everything but the
    TensorRT calls runs for real."""
    built = []

    def plans(exp, stages, machine, cfg, out, cache, log):
        for name, meta in stages.items():
            built.append(name)
            (out / meta["plan"]).write_bytes(name.encode())
        return cache + b"timing"

    monkeypatch.setattr(build, "probe_machine", lambda what: H200)
    monkeypatch.setattr(build, "_build_plans", plans)
    return built


def test_profiles_per_stage(export_dir):
    stages = plan_stages(load_export(export_dir), BuildConfig(max_batch=4))
    target = {p["name"]: p["shapes"] for p in stages["target"]["profiles"]}
    assert list(target) == ["decode", "prefill"]
    assert target["decode"]["mask"] == [[1, 1], [17, 17], [17, 17]]  # N: 1 .. budget + 1
    assert target["decode"]["past_positions"] == [[0], [256], [512]]  # P: 0 .. max context
    assert target["decode"]["past_k"] == [[4, 2, 1, 24], [4, 2, 256, 24], [4, 2, 512, 24]]  # C: 1 .. max context
    assert target["prefill"]["ids"] == [[1], [256], [512]]
    assert [p["name"] for p in stages["domino.context"]["profiles"]] == ["decode", "prefill"]
    block = stages["domino.block"]["profiles"]
    assert len(block) == 1 and block[0]["shapes"]["root"] == [[1], [1], [1]]
    # rows: a shape tensor, its values from 1 to k_draft (opt: the rows a tree of the budget reaches)
    assert block[0]["shapes"]["rows"] == [[1], [1], [1]] and block[0]["values"] == {"rows": [[1], [8], [8]]}
    setup = stages["domino.scorer_setup"]["profiles"]
    assert setup[0]["shapes"]["base"] == [[1, 128], [8, 128], [8, 128]] and "values" not in setup[0]
    children = stages["domino.scorer_children"]["profiles"][0]["shapes"]
    assert children["states"] == [[1, 32], [1, 32], [17, 32]] and children["w2c"] == [[64, 32]] * 3
    assert stages["domino.frontier"]["profiles"][0]["shapes"]["ph"] == [[1, 8, 96], [1, 8, 96], [4, 8, 96]]


def test_profiles_hold_the_chain_methods_trees():
    # a chain verifies k_draft + 1 tokens whatever the budget; the heap advances node_topk states at once
    limits = Limits(budget=4, k_draft=15, node_topk=8, max_context=1024, max_batch=1)
    inputs = {"ids": {"dims": ["N"]}}
    assert stage_profiles("target", inputs, limits)[0].shapes["ids"] == ((1,), (5,), (16,))
    small = Limits(budget=2, k_draft=2, node_topk=8, max_context=64, max_batch=1)
    advance = stage_profiles("domino.scorer_advance", {"tokens": {"dims": ["N"]}}, small)
    assert advance[0].shapes["tokens"] == ((1,), (8,), (8,))
    with pytest.raises(DtrtError, match="dynamic dim 'T'"):
        stage_profiles("target", {"ids": {"dims": ["T"]}}, limits)


def test_select_profile(export_dir):
    from dtrt.engines.profile_bounds import Profile

    profiles = [Profile.from_json(p) for p in plan_stages(load_export(export_dir), BuildConfig())["target"]["profiles"]]
    cache = {"past_k": (4, 2, 400, 24), "past_v": (4, 2, 400, 24)}
    verify = {"ids": (17,), "positions": (17,), "mask": (17, 17), **cache, "past_positions": (300,)}
    assert select_profile(profiles, verify) == 0
    prompt = {**verify, "ids": (300,), "positions": (300,), "mask": (300, 300), "past_positions": (0,)}
    assert select_profile(profiles, prompt) == 1
    with pytest.raises(ValueError, match=r"input past_k of shape \[4, 2, 600, 24\] is outside"):
        select_profile(profiles, {**verify, "past_k": (4, 2, 600, 24)})


def test_engine_key_and_layout(tmp_path):
    assert H200.key == "nvidia-h200-sm90-trt11.4.0.106-cu12.8"
    assert (
        Machine("NVIDIA GeForce RTX 5080", "12.0", "11.4.0.106", "13.0").key
        == "nvidia-geforce-rtx-5080-sm120-trt11.4.0.106-cu13.0"
    )
    assert engine_dir(tmp_path, H200, "tiny") == tmp_path / H200.key / "tiny"


def test_build_writes_the_engine_directory(export_dir, tmp_path, fake_trt, monkeypatch, capsys):
    root = tmp_path / "engines"
    code, out, err = run_cli(monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(root))
    assert code == 0, err
    path = root / H200.key / "tiny"
    assert out.strip().startswith(f"{path}: {len(STAGES)} plans")
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [*(f"{s}.plan" for s in STAGES), "manifest.json", "timing.cache"]
    )
    assert sorted(p.name for p in root.iterdir()) == [H200.key] and list((root / H200.key).iterdir()) == [path]
    eng = read_engine(path)
    m = eng.manifest
    assert m["machine"] == H200.to_json() and m["key"] == H200.key and m["model"] == "tiny"
    assert m["plugins"] == {
        "namespace": "dtrt",
        "version": "1",
        "sha256": sources_sha256(),
        "ops": ["TreeAttention", "TopMCorrectedScore", "LedgerSelect", "TreeGatedDeltaNet", "TreeCausalConv1d"],
    }
    assert m["export"]["path"] == str(export_dir.resolve())
    assert m["stages"]["target"]["outputs"]["logits"] == {"dims": ["N", 128], "dtype": "FLOAT"}
    assert (path / "timing.cache").read_bytes() == b"timing"
    assert check_engine(eng, H200, sources_sha256()).path == export_dir

    code, _, err = run_cli(monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(root))
    assert code == 2 and "already exists; pass --force" in err
    code, _, err = run_cli(
        monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(root), "--force", "--max-batch", "2"
    )
    assert code == 0, err
    assert read_engine(path).manifest["build"] == {"max_batch": 2, "opt_level": 3}
    assert (path / "timing.cache").read_bytes() == b"timingtiming"  # the old cache was loaded into the rebuild


def test_failed_build_leaves_nothing(export_dir, tmp_path, monkeypatch):
    def fail(exp, stages, machine, cfg, out, cache, log):
        (out / "target.plan").write_bytes(b"half")
        raise DtrtError("domino.block: TensorRT could not build it")

    monkeypatch.setattr(build, "probe_machine", lambda what: H200)
    monkeypatch.setattr(build, "_build_plans", fail)
    root = tmp_path / "engines"
    with pytest.raises(DtrtError, match="could not build"):
        build_engines(export_dir, root)
    assert list((root / H200.key).iterdir()) == []


def test_a_build_that_would_not_fit_is_refused_before_it_starts(export_dir, tmp_path, fake_trt, monkeypatch, capsys):
    from dtrt.artifacts import files

    need = sum(f.stat().st_size for f in export_dir.iterdir() if f.name != "manifest.json")
    monkeypatch.setattr(files, "free_space", lambda path: need - 1)
    root = tmp_path / "engines"
    code, out, err = run_cli(monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(root))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    where = root / H200.key / "tiny"
    assert f"this build writes about {need / 1e9:.2f} GB at {where} and that disk has" in err
    assert err.rstrip().endswith("free space there, or build elsewhere (`--out DIR`)")
    assert fake_trt == [] and not where.exists()
    monkeypatch.setattr(files, "free_space", lambda path: need)
    code, out, err = run_cli(monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(root))
    assert code == 0, err


@pytest.mark.skipif(tensorrt_status()[0] is not None, reason="TensorRT is installed here")
def test_build_engine_without_tensorrt(export_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "engines"
    code, stdout, err = run_cli(monkeypatch, capsys, "build-engine", str(export_dir), "--out", str(out))
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: dtrt build-engine needs TensorRT and a CUDA GPU: ")
    assert 'TensorRT is not installed (pip install "dtrt[trt]" on a machine with a CUDA GPU)' in err
    assert not out.exists()


@pytest.mark.skipif(tensorrt_status()[0] is not None, reason="TensorRT is installed here")
def test_tensorrt_backend_without_tensorrt(tmp_path):

    with pytest.raises(DtrtError, match="^--backend tensorrt needs TensorRT and a CUDA GPU: TensorRT is not inst"):
        pipe_for(None, spec(), backend="tensorrt", engines=tmp_path)
    with pytest.raises(DtrtError, match="--backend tensorrt needs --engines DIR"):
        pipe_for(None, spec(), backend="tensorrt")


def rebuild(path, export_dir):
    return (
        f"rebuild with `dtrt build-engine {export_dir.resolve()} --out {path.parent.parent} --max-batch 8 "
        f"--opt-level 3 --force`"
    )


@pytest.mark.parametrize(
    "field,value,label",
    [
        ("gpu_name", "NVIDIA H100 80GB HBM3", "'NVIDIA H200'"),
        ("compute_capability", "8.9", "'9.0'"),
        ("tensorrt_version", "11.1.0.3", "'11.4.0.106'"),
        ("cuda_version", "13.0", "'12.8'"),
    ],
)
def test_engine_refused_on_another_machine(export_dir, tmp_path, fake_trt, field, value, label):
    path = build_engines(export_dir, tmp_path / "engines").path
    other = Machine(**{**H200.to_json(), field: value})
    with pytest.raises(DtrtError) as e:
        check_engine(read_engine(path), other, sources_sha256())
    assert str(e.value) == (
        f"{path / 'manifest.json'}: {field} {label} differs from this machine's {value!r} "
        f"(the plans only run on the {LABELS[field]} they were built for); "
        f"{rebuild(path, export_dir)}"
    )


def test_engine_checks(export_dir, tmp_path, fake_trt):
    path = build_engines(export_dir, tmp_path / "engines").path
    with pytest.raises(DtrtError, match=r"plugins.sha256 differs from this dtrt's plugin kernels .*" + "rebuild with"):
        check_engine(read_engine(path), H200, "0" * 64)
    plan = path / "domino.block.plan"
    plan.write_bytes(b"x")
    with pytest.raises(
        DtrtError,
        match=f"{plan}: 1 bytes, the manifest records 12 \\(truncated or modified\\); rebuild with `dtrt build-engine",
    ):
        read_engine(path)
    plan.write_bytes(b"domino.block")
    m = json.loads((export_dir / MANIFEST).read_text())
    m["budget"] = 32
    (export_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DtrtError, match="built from another export than .* holds now .*; rebuild with"):
        check_engine(read_engine(path), H200, sources_sha256())
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "dtrt_version": "0.0.1"}))
    with pytest.raises(DtrtError, match=f"written by dtrt 0.0.1, this is dtrt {__version__}; rebuild with"):
        read_engine(path)
    with pytest.raises(DtrtError, match="not a dtrt engine directory; build it with `dtrt build-engine"):
        read_engine(tmp_path)


def test_resolve_engine_dir(export_dir, tmp_path, fake_trt):
    root = tmp_path / "engines"
    path = build_engines(export_dir, root).path
    assert resolve_engine_dir(path, H200) == path
    assert resolve_engine_dir(root, H200) == path and resolve_engine_dir(root, H200, "tiny") == path
    other = Machine("NVIDIA L4", "8.9", "11.4.0.106", "12.8")
    with pytest.raises(
        DtrtError, match=rf"no engines for this machine \({other.key}\) \(it has engines for: {H200.key}\)"
    ):
        resolve_engine_dir(root, other)
    build_engines(write_export(tmp_path / "exports" / "other", model="other"), root)
    with pytest.raises(DtrtError, match="holds engines for other, tiny; pass --engines"):
        resolve_engine_dir(root, H200)
    assert resolve_engine_dir(root, H200, "other") == root / H200.key / "other"


def test_stage_buffers_and_graphs(export_dir):
    stages = plan_stages(load_export(export_dir), BuildConfig(max_batch=4))
    assert plan_buffers(stages["target"])["logits"] == ((512, 128), torch.float32)  # the prefill profile's N
    assert plan_buffers(stages["domino.frontier"])["mask"] == ((4, 17, 17), torch.bool)
    assert graph_key(stages["target"], {"ids": (17,)}) is None  # P changes every round
    assert graph_key(stages["domino.block"], {"root": (1,)}) is None
    assert plan_buffers(stages["domino.block"])["base"] == ((8, 128), torch.float32)  # R: the rows' largest value
    assert host_inputs(stages["domino.block"]) == {"rows"} and not host_inputs(stages["domino.scorer_setup"])
    no_past = {**stages["domino.block"], "inputs": {"rows": {"dims": [1], "dtype": "INT64"}}}
    assert graph_key(no_past, {"rows": (1,)}) is None  # a shape tensor is read on the host: no CUDA graph
    assert graph_key(stages["domino.scorer_setup"], {"ph": (3, 96), "base": (3, 128)}) is not None
    key = graph_key(stages["domino.scorer_children"], {"zproj": (32,), "states": (1, 32)})
    assert key == (("states", (1, 32)), ("zproj", (32,)))
    assert graph_key(stages["domino.frontier"], {"ph": (1, 8, 96)}) is not None


TRITON_PTX = """//
.visible .entry add_kernel(
\t.param .u64 .ptr .global .align 1 add_kernel_param_0,
\t.param .u32 add_kernel_param_1,
\t.param .u64 .ptr .global .align 1 add_kernel_param_2,
\t.param .u64 .ptr .global .align 1 add_kernel_param_3,
\t.param .u64 .ptr .global .align 1 add_kernel_param_4
)
.reqntid 128
{
\tld.param.b64 \t%rd3, [add_kernel_param_0];
\tld.param.b32 \t%r3, [add_kernel_param_1];
\tld.param.b64 \t%rd4, [add_kernel_param_2];
}
"""


def test_strip_hidden_params():
    ptx = strip_hidden_params(TRITON_PTX, "add_kernel", 3)
    entry = ptx[ptx.index(".entry") : ptx.index(")")]
    assert entry.count(".param") == 3 and "add_kernel_param_2" in entry and "param_3" not in ptx
    assert ptx.endswith(TRITON_PTX[TRITON_PTX.index(")") :])
    with pytest.raises(ValueError, match="reads its hidden parameter add_kernel_param_2"):
        strip_hidden_params(TRITON_PTX, "add_kernel", 2)
    with pytest.raises(ValueError, match="declares 5 parameters, the kernel has 6"):
        strip_hidden_params(TRITON_PTX, "add_kernel", 6)

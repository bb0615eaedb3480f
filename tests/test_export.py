"""`dtrt export`: graph contents, sharded checkpoints, atomic output, and the artifact checks on load."""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from helpers import run_cli

from dtrt.artifacts.export import MANIFEST, check_source, load_export
from dtrt.errors import DtrtError
from dtrt.exporter import write as export_mod
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.write import export_pair
from dtrt.models.checkpoint import load_target, save_checkpoint, target_state
from dtrt.models.pair import Pair


def test_graphs_have_dtrt_nodes_with_functions_and_dynamic_dims(tiny_export):
    m = onnx.load(str(tiny_export.stage("target")), load_external_data=False)
    assert sum(n.domain == "dtrt" and n.op_type == "TreeAttention" for n in m.graph.node) == 4
    assert [(f.domain, f.name) for f in m.functions] == [("dtrt", "TreeAttention")]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    assert dims["ids"] == ["N"] and dims["mask"] == ["N", "N"] and dims["past_k"][2] == "C"
    assert dims["past_positions"] == ["P"]
    # each layer reads its past with one Slice of the cache (layer and positions), never a copy of the whole past
    reads = [n for n in m.graph.node if {"past_k", "past_v"} & set(n.input)]
    assert len(reads) == 2 * 4 and {n.op_type for n in reads} == {"Slice"}
    manifest = tiny_export.manifest
    assert manifest["op_flavour"] == "dtrt-functions" and manifest["opset"] == 20
    assert {"target", "dflash.context", "dflash.block", "domino.context", "domino.block"} <= manifest["stages"].keys()
    assert (tiny_export.path / "tokenizer" / "tokenizer.json").is_file()
    load_export(tiny_export.path, full_check=True)


@pytest.mark.slow
def test_sharded_checkpoint_exports(tiny, tmp_path):
    target = load_target(tiny.target)
    src = tmp_path / "sharded"
    save_checkpoint(src, json.loads((tiny.target / "config.json").read_text()), target_state(target), shards=2)
    exp = export_pair(Pair(src), tmp_path / "out", ExportConfig(max_context=64))
    assert set(exp.manifest["source"]["target_hashes"]) == {
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert list(exp.manifest["stages"]) == ["target"]


def test_failed_export_leaves_nothing(tiny, tmp_path, monkeypatch):
    import onnx

    calls = []

    def failing(stage, path, *a):
        calls.append(stage.name)
        if len(calls) == 2:
            raise RuntimeError("boom")
        onnx.save_model(onnx.helper.make_model(onnx.helper.make_graph([], stage.name, [], [])), str(path))

    monkeypatch.setattr(export_mod, "export_stage", failing)
    with pytest.raises(RuntimeError):
        export_pair(tiny, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_export_flags(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(DtrtError, match="already exists; pass --force"):
        export_pair(tiny, tmp_path / "out")
    with pytest.raises(DtrtError, match="--dtype int4: export supports fp32, fp16, bf16"):  # bf16: test_precision.py
        export_pair(tiny, tmp_path / "x", ExportConfig(dtype="int4"))


@pytest.fixture
def copied(tiny_export, tmp_path):
    dst = tmp_path / "exp"
    shutil.copytree(tiny_export.path, dst)
    return dst


def one_line_error(fn, *fragments):
    with pytest.raises(DtrtError) as e:
        fn()
    assert "\n" not in str(e.value)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_bad_artifacts(copied, tiny_export):
    (copied / "weights.data").unlink()
    one_line_error(lambda: load_export(copied), "weights.data", "missing", "dtrt export --model tiny")
    data = bytearray((tiny_export.path / "weights.data").read_bytes())
    data[len(data) // 2] ^= 1  # the right size, not the file
    (copied / "weights.data").write_bytes(bytes(data))
    one_line_error(lambda: load_export(copied), "weights.data", "sha256 differs", "dtrt export --model tiny")
    shutil.copy2(tiny_export.path / "weights.data", copied / "weights.data")
    data = copied / "target.onnx"
    data.write_bytes(data.read_bytes()[:-100])
    one_line_error(lambda: load_export(copied), "target.onnx", "truncated", "--force")
    manifest = json.loads((copied / MANIFEST).read_text())
    manifest["dtrt_version"] = "0.0.1"
    (copied / MANIFEST).write_text(json.dumps(manifest))
    one_line_error(lambda: load_export(copied), "manifest.json", "dtrt 0.0.1", "dtrt export")
    (copied / MANIFEST).unlink()
    one_line_error(lambda: load_export(copied), "manifest.json", "not found")
    one_line_error(lambda: load_export(copied / "nope"), "not found", "dtrt export")


def test_export_from_another_model(tiny_export, tmp_path):
    exp = load_export(tiny_export.path)
    one_line_error(
        lambda: check_source(exp, exp.manifest["source"]["target"], model="qwen3-4b"),
        "exported from model 'tiny'",
        "qwen3-4b",
    )
    other = tmp_path / "other"
    shutil.copytree(exp.manifest["source"]["target"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    one_line_error(lambda: check_source(exp, other), "another target checkpoint", "dtrt export")


def test_every_weight_is_stored_once(tiny_export):
    """The stages read their initializers from one shared file, each distinct tensor once (DFlash's body and the
    Domino drafter's, the target's embedding in every block, scorer and frontier stage)."""
    import hashlib

    import onnx

    from dtrt.exporter.weights import WEIGHTS, external

    path = tiny_export.path
    assert not list(path.glob("*.onnx.data"))
    seen = {}  # (offset, length) -> sha256
    for meta in tiny_export.manifest["stages"].values():
        for init in onnx.load(str(path / meta["file"]), load_external_data=False).graph.initializer:
            info = external(init)
            if info is None:
                continue
            assert info["location"] == WEIGHTS and int(info["offset"]) % 4096 == 0
            with open(path / WEIGHTS, "rb") as f:
                f.seek(int(info["offset"]))
                seen[(int(info["offset"]), int(info["length"]))] = hashlib.sha256(f.read(int(info["length"]))).digest()
    assert len(set(seen.values())) == len(seen), "a tensor stored twice"
    w = tiny_export.manifest["weights"]
    assert w["distinct"] == len(seen) < w["tensors"] and w["stored"] < w["bytes"]
    assert (path / WEIGHTS).stat().st_size < w["stored"] + 4096 * w["distinct"]


@pytest.mark.slow
def test_only_the_drafters_asked_for(tiny, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(
        monkeypatch, capsys, "export", "--model", "tiny", "--out", str(tmp_path / "e"), "--drafters", "dflash",
        "--max-context", "256",
    )  # fmt: skip
    assert code == 0, err
    exp = load_export(tmp_path / "e")
    assert set(exp.drafters) == {"dflash"} and not any(s.startswith("domino.") for s in exp.manifest["stages"])
    assert "--drafters dflash" in exp.fix_hint()
    code, out, err = run_cli(monkeypatch, capsys, "export", "--model", "tiny", "--out", str(tmp_path / "x"),
                             "--drafters", "eagle")  # fmt: skip
    assert code == 2 and err == "error: --drafters 'eagle': use some of dflash, domino\n"
    hybrid_like = Pair(tiny.target, None, tiny.domino)
    with pytest.raises(DtrtError, match=r"^--drafters dflash: the pair has no dflash drafter \(it has: domino\)$"):
        export_pair(hybrid_like, tmp_path / "y", ExportConfig(drafters=("dflash",)))


def test_export_cli_takes_every_dtype_the_exporter_supports(tiny, monkeypatch, capsys, tmp_path):
    """`dtrt export --dtype D` reaches the exporter for every dtype it supports (the CLI's choice once refused
    bf16); the bf16 export itself: tests/test_precision.py."""
    import dtrt.exporter.write as write
    from dtrt.exporter.export_config import EXPORT_DTYPES

    asked = []

    def exporter(pair, out, cfg, **kw):
        asked.append(cfg.dtype)
        raise DtrtError(f"stopped before exporting {cfg.dtype}")

    monkeypatch.setattr(write, "export_pair", exporter)
    for dtype in EXPORT_DTYPES:
        flags = ("--model", "tiny", "--dtype", dtype, "--out", str(tmp_path))
        code, _, err = run_cli(monkeypatch, capsys, "export", *flags)
        assert code == 2 and err == f"error: stopped before exporting {dtype}\n", err
    assert asked == list(EXPORT_DTYPES) and "bf16" in asked


def test_the_function_bodies_are_the_same_bytes_in_every_process():
    """onnxscript orders a Loop's carried variables by a set of their names, which the string hash seed orders
    differently from process to process (LedgerSelect's, and the hybrid ops'): dtrt.ops.base.canonical_loops puts
    them in one order."""
    script = (
        "import hashlib; from dtrt.ops.base import onnx_functions; from dtrt.ops.functions import FUNCTIONS; "
        "print({p.name: hashlib.sha256(p.SerializeToString(deterministic=True)).hexdigest() "
        "for p in onnx_functions(sorted(FUNCTIONS))})"
    )
    seen = set()
    for seed in range(6):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        seen.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True).stdout)
    assert len(seen) == 1 and "LedgerSelect" in next(iter(seen)) and "TreeGatedDeltaNet" in next(iter(seen))


@pytest.mark.parametrize("heads, kv_heads, n, past", [(9, 3, 2, 40), (4, 2, 7, 0), (4, 4, 5, 17), (6, 1, 9, 3)])
def test_tree_attention_function_is_the_reference(heads, kv_heads, n, past):
    """The TreeAttention function ONNX Runtime runs (the exported targets' attention where dtrt's kernel is not
    built) against the op's reference: GQA, a past, a tree mask; it groups query heads instead of repeating K/V
    heads, so its body holds no Expand (a copy of the whole past per layer)."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from dtrt.exporter.stage_modules import random_tree_mask
    from dtrt.ops import onnx_functions
    from dtrt.ops.tree_attention import tree_attention_ref

    (fn,) = onnx_functions(["TreeAttention"])
    assert "Expand" not in {node.op_type for node in fn.node}
    io = [("q", TensorProto.FLOAT), ("k", TensorProto.FLOAT), ("v", TensorProto.FLOAT), ("mask", TensorProto.BOOL)]
    graph = helper.make_graph(
        [helper.make_node("TreeAttention", [name for name, _ in io], ["o"], domain="dtrt")],
        "attention",
        [helper.make_tensor_value_info(name, t, None) for name, t in io],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("dtrt", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[fn])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(n + past)
    q = torch.randn(heads, n, 16, generator=g)
    k, v = (torch.randn(kv_heads, past + n, 16, generator=g) for _ in range(2))
    mask = torch.cat((torch.ones(n, past, dtype=torch.bool), random_tree_mask(n, g)[1]), 1)
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "mask": mask.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), tree_attention_ref(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_the_rules_left_out_are_left_out_only_during_the_export():
    from onnxscript import rewriter

    from dtrt.exporter.onnx_export import SKIPPED_RULES, default_rules_without

    names = [getattr(r, "name", None) for r in rewriter._DEFAULT_REWRITE_RULES]
    assert set(SKIPPED_RULES) <= set(names)  # a rule onnxscript renamed or dropped: SKIPPED_RULES is stale
    with default_rules_without(SKIPPED_RULES):
        inside = [getattr(r, "name", None) for r in rewriter._DEFAULT_REWRITE_RULES]
    assert inside == [n for n in names if n not in SKIPPED_RULES]
    assert [getattr(r, "name", None) for r in rewriter._DEFAULT_REWRITE_RULES] == names


def test_stages_name_no_path_of_the_machine_that_exported_them(tiny_export):
    """No stage holds torch.onnx's per-node stack traces, so none names where dtrt or torch is installed; the nodes
    keep their module path."""
    import dtrt
    from dtrt.exporter.onnx_export import STACK_TRACE

    installed = [str(Path(m.__file__).resolve().parent.parent).encode() for m in (dtrt, torch)]
    graphs = sorted(tiny_export.path.glob("*.onnx"))
    assert len(graphs) > 5
    for path in graphs:
        assert not any(where in path.read_bytes() for where in installed), path.name
        model = onnx.load(str(path), load_external_data=False)
        keys = {p.key for n in model.graph.node for p in n.metadata_props}
        assert STACK_TRACE not in keys and "namespace" in keys, path.name


def test_stack_traces_dropped_in_subgraphs_and_functions_too():
    from onnx import helper

    from dtrt.exporter.onnx_export import STACK_TRACE, drop_stack_traces

    def node(*args, **kwargs):
        n = helper.make_node(*args, **kwargs)
        helper.set_metadata_props(n, {STACK_TRACE: 'File "/home/me/dtrt/x.py", line 1', "namespace": "m"})
        return n

    body = helper.make_graph([node("Identity", ["c"], ["d"])], "body", [], [])
    top = [node("Identity", ["a"], ["b"]), node("If", ["cond"], ["e"], then_branch=body, else_branch=body)]
    fn = helper.make_function("dtrt", "F", ["x"], ["y"], [node("Identity", ["x"], ["y"])], [])
    model = helper.make_model(helper.make_graph(top, "g", [], []), functions=[fn])
    assert drop_stack_traces(model) == 5  # the two nodes, each branch's node, the function's
    assert b"/home/me" not in model.SerializeToString()
    assert {p.key for p in model.graph.node[0].metadata_props} == {"namespace"}


def test_a_process_builds_the_torchlib_registry_once(tiny, tmp_path, monkeypatch):
    """Two stages exported in one process build torch.onnx's registry of torchlib functions once, only while they
    export, and the stage exported with the registry already built is the same bytes."""
    from torch.onnx._internal.exporter import _registration

    from dtrt.exporter import onnx_export
    from dtrt.exporter.scorer_stages import scorer_stages
    from dtrt.models.checkpoint import load_drafter

    built = []
    build = vars(_registration.ONNXRegistry)["from_torchlib"]

    def counted(cls, *args, **kwargs):
        built.append(args or kwargs)
        return build.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counted))
    monkeypatch.setattr(onnx_export, "_REGISTRIES", {})  # as in a fresh process
    stage = next(s for s in scorer_stages(load_target(tiny.target), load_drafter(tiny.domino), 3, 4, 4)
                 if s.name == "scorer_children")  # fmt: skip
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        onnx_export.export_stage(stage, tmp_path / name / "stage.onnx", 64, 64)
    assert len(built) == 1  # 0: torch.onnx.export no longer builds it there, and the hook is stale
    files = {p.name: p.read_bytes() for p in (tmp_path / "first").iterdir()}
    assert files and files == {p.name: p.read_bytes() for p in (tmp_path / "second").iterdir()}
    _registration.ONNXRegistry.from_torchlib(opset_version=onnx_export.OPSET)
    assert len(built) == 2  # outside an export, torch's own


@pytest.mark.slow
def test_the_rules_left_out_never_fire(tiny, tmp_path, monkeypatch):
    """The rules the export leaves out of onnxscript's defaults (SKIPPED_RULES) never fire on dtrt's stages, so their
    graphs are the same bytes without them: the tiny pair's stages and the hybrid target's (its drafter's stages are
    the tiny pair's), exported with every default rule, each left-out rule tried and never rewriting."""
    from onnxscript import rewriter

    from dtrt.exporter import onnx_export
    from dtrt.exporter.stage_modules import target_stage
    from dtrt.exporter.write import load_models
    from dtrt.zoo.registry import tiny_hybrid_pair

    left_out, tries, fires = onnx_export.SKIPPED_RULES, Counter(), Counter()
    for rule in rewriter._DEFAULT_REWRITE_RULES:
        if (name := getattr(rule, "name", None)) in left_out:

            def counted(*args, _try=rule.try_rewrite, _name=name, **kwargs):
                tries[_name] += 1
                out = _try(*args, **kwargs)
                fires[_name] += out is not None
                return out

            monkeypatch.setattr(rule, "try_rewrite", counted)
    monkeypatch.setattr(onnx_export, "SKIPPED_RULES", ())
    export_pair(tiny, tmp_path / "tiny", ExportConfig(max_context=512, jobs=1), model="tiny")
    hybrid = tiny_hybrid_pair()
    target, _, taps = load_models(hybrid.target, {"domino": hybrid.domino}, None)
    onnx_export.export_stage(target_stage(target, taps), tmp_path / "hybrid-target.onnx", 512, 512)
    assert set(tries) == set(left_out) and all(tries[n] > 100 for n in left_out), tries  # a match was looked for
    assert sum(fires.values()) == 0, fires

"""The ONNX Runtime backend on the exported tiny pair: the torch backend's tokens (= the AR tokens at T=0) with
drafts accepted, stage outputs and caches equal to TorchBackend's, the CLI path, and bad exports as one-line errors."""

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from helpers import generate_all, pipe_for, spec
from test_loading import run_cli

from dtrt import cli
from dtrt.artifacts.export import load_export
from dtrt.artifacts.files import write_manifest
from dtrt.errors import DtrtError
from dtrt.exporter.stage_modules import random_tree_mask
from dtrt.runtime.backends.exported import SCORER_STAGES
from dtrt.runtime.backends.kv import LayerKV, TargetKV
from dtrt.runtime.backends.onnxruntime import OrtBackend
from dtrt.tree import CostCurve

VARIANTS = [
    spec("dflash"),
    spec("ddtree"),
    spec("caddtree", budget=32),
    spec("dominotree", arm="marg"),
    spec("dominotree", arm="marg", builder="frontier"),
]
DOMINO_VARIANTS = [
    spec("domino"),
    spec("dominotree"),
    spec("dominotree", builder="frontier"),
    spec("dominotree", arm="condstatic"),
    spec("cadominotree", budget=32),
]


LINEAR_COST = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)


def ids(d) -> str:
    return f"{d.method}-{d.builder}-{d.arm}-b{d.budget}"


def ort_pipeline(exp, draft):
    return pipe_for(None, draft, backend="onnxruntime", export=exp.path, threads=1)


def test_ar_matches_torch(tiny_export, torch_tokens):
    gens = generate_all(ort_pipeline(tiny_export, spec("ar")))
    assert [g.tokens for g in gens] == torch_tokens
    assert all(r.accepted == 1 and r.tree_size == 1 for g in gens for r in g.rounds)


def check_speculative(pipe, draft, torch_tokens):
    if draft.method in ("caddtree", "cadominotree"):  # a fixed cost curve where drafts pay: a measured one varies
        pipe.method.curve = LINEAR_COST  # with load, and on the tiny pair drafting may rightly not pay at all
    gens = generate_all(pipe)
    assert [g.tokens for g in gens] == torch_tokens
    rounds = [r for g in gens for r in g.rounds]
    mean_accepted = sum(r.accepted for r in rounds) / len(rounds)
    assert mean_accepted > 2, mean_accepted
    assert max(r.tree_size for r in rounds) > 1 and all(r.tree_size <= draft.budget + 1 for r in rounds)


@pytest.mark.parametrize("draft", VARIANTS, ids=ids)
def test_methods_match_torch_with_accepted_drafts(tiny_export, torch_tokens, draft):
    pipe = ort_pipeline(tiny_export, draft)
    assert pipe.backend.name == "onnxruntime" and pipe.backend.kind == "dflash"
    check_speculative(pipe, draft, torch_tokens)


@pytest.mark.parametrize("draft", DOMINO_VARIANTS, ids=ids)
def test_domino_scorer_stages(tiny_export, torch_tokens, draft):
    if not set(SCORER_STAGES) <= tiny_export.manifest["stages"].keys():
        pytest.skip("the export has no Domino scorer stages")
    pytest.importorskip("dtrt.scoring.stages")
    pipe = ort_pipeline(tiny_export, draft)
    assert pipe.backend.kind == "domino"
    check_speculative(pipe, draft, torch_tokens)


def test_stages_and_caches_match_torch(tiny, tiny_export):
    """Prefill, a partly accepted tree and a probe: outputs and both caches equal TorchBackend's."""
    ref = pipe_for(tiny, spec("ddtree")).backend
    ort = OrtBackend(tiny_export, "dflash", threads=1)
    gen = torch.Generator().manual_seed(0)
    vocab = tiny_export.manifest["target"]["vocab_size"]

    def same(a, b):
        torch.testing.assert_close(torch.as_tensor(b), a.float(), rtol=1e-4, atol=1e-4)

    def forward_both(tokens, positions, mask):
        outs = [b.target_forward(tokens, positions, mask) for b in (ref, ort)]
        for a, b in zip(*outs):
            same(a, b)
        return outs[0][1]

    def caches_equal():
        p, c = ref.cache.past, ref.draft_cache.length
        assert ort.past == p and ort.draft_cache.length == c
        for a, b in zip((ref.cache.k, ref.cache.v), (ort.cache.k, ort.cache.v)):
            same(a[:, :, :p], b[:, :, :p])
        for a, layers in zip((ref.draft_cache.k, ref.draft_cache.v), ort.draft_cache.view()):
            same(a[:, :, :c], torch.stack(layers).transpose(1, 2))  # per layer [c, kv_heads, head_dim]

    def block_both(root):
        """Every row from the reference; from ONNX Runtime the first `rows` of them, for a few `rows`."""
        depth = ref.drafter.cfg.k_draft
        full = ref.draft_block(root, ref.past, rows=depth)
        for rows in (1, 3, depth):
            got = ort.draft_block(root, ort.past, rows=rows)
            assert [tuple(x.shape) for x in got] == [(rows, x.shape[1]) for x in full]
            for a, b in zip(full, got):
                same(a[:rows], b)

    for b in (ref, ort):
        b.reset(64)
    n = 11
    hidden = forward_both(
        torch.randint(0, vocab, (n,), generator=gen), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    )
    for b in (ref, ort):
        b.commit(torch.arange(n))
        b.draft_context(hidden, torch.arange(n))
    caches_equal()
    block_both(5)

    for accepted in ([0, 2, 5], [0], [0, 1, 3, 4, 8]):
        depth, mask = random_tree_mask(9, gen)
        start = ref.past
        hidden = forward_both(torch.randint(0, vocab, (9,), generator=gen), start + depth, mask)
        for b in (ref, ort):
            b.commit(accepted)
            b.draft_context(hidden[accepted], start + torch.arange(len(accepted)))
        caches_equal()
        block_both(7)

    for b in (ref, ort):  # the CaDDTree probes write past the committed entries only
        b.time_verify(9, b.capacity - 9)
        b.time_draft(rows=2)
    caches_equal()
    forward_both(torch.tensor([3, 4]), ref.past + torch.arange(2), torch.ones(2, 2, dtype=torch.bool).tril())


def test_target_kv_appends_in_place():
    rng = np.random.default_rng(0)
    cache = TargetKV(3, 2, 4, capacity=40, dtype=torch.float32)
    ref_k, ref_v = torch.zeros((3, 2, 0, 4)), torch.zeros((3, 2, 0, 4))
    first = None
    for n in (5, 1, 0, 3, 7, 2, 22):
        k, v = torch.from_numpy(rng.standard_normal((2, 3, 2, n, 4), dtype=np.float32))
        cache.append(k, v)
        ref_k, ref_v = torch.cat((ref_k, k), dim=2), torch.cat((ref_v, v), dim=2)
        feeds = cache.feeds()
        # the stage gets the whole buffer, unmoved, and the past's length
        assert feeds["past_k"].data_ptr() == cache.k.data_ptr() and feeds["past_k"].shape == (3, 2, 40, 4)
        assert torch.equal(feeds["past_positions"], torch.arange(ref_k.shape[2]))
        assert torch.equal(cache.k[:, :, : cache.length], ref_k) and torch.equal(cache.v[:, :, : cache.length], ref_v)
        first = cache.k[2, 1, 0].clone() if first is None else first
        assert torch.equal(cache.k[2, 1, 0], first)  # an append never moves what is stored
    assert cache.feeds(length=38)["past_positions"].shape == (38,)  # the cost probes' longer past
    with pytest.raises(RuntimeError, match="overflow"):
        cache.append(k[:, :, :1], v[:, :, :1])
    cache.reset()
    cache.append(k[:, :, :2], v[:, :, :2])
    assert cache.feeds()["past_positions"].tolist() == [0, 1] and torch.equal(cache.k[:, :, :2], k[:, :, :2])


def test_layer_kv_appends_without_moving_the_past():
    """Each layer's view is its stored positions, position-major and contiguous, at the same address after every
    append (nothing stored moves), equal to the context stage outputs appended so far."""
    rng = np.random.default_rng(0)
    cache = LayerKV(3, 2, 4, capacity=40, dtype=torch.float32)
    ref_k, ref_v = torch.zeros((3, 2, 0, 4)), torch.zeros((3, 2, 0, 4))
    addresses = [layer.data_ptr() for layer in cache.k]  # a view of 0 positions reports address 0
    for n in (5, 1, 0, 3, 7, 2, 22):
        k, v = torch.from_numpy(rng.standard_normal((2, 3, 2, n, 4), dtype=np.float32))
        cache.append(k, v)
        ref_k, ref_v = torch.cat((ref_k, k), dim=2), torch.cat((ref_v, v), dim=2)
        view_k, view_v = cache.view()
        assert len(view_k) == 3 and all(t.is_contiguous() for t in view_k + view_v)
        assert [t.data_ptr() for t in view_k] == addresses
        for i in range(3):
            assert torch.equal(view_k[i], ref_k[i].transpose(0, 1)) and torch.equal(view_v[i], ref_v[i].transpose(0, 1))
    with pytest.raises(RuntimeError, match="overflow"):
        cache.append(k[:, :, :1], v[:, :, :1])
    cache.reset()
    cache.append(k[:, :, :2], v[:, :, :2])
    assert torch.equal(cache.view()[0][1], k[1, :, :2].transpose(0, 1))


# the CLI and bad exports


def test_cli_run(tiny_export, monkeypatch, capsys):
    def run(*args):
        monkeypatch.setattr(
            sys,
            "argv",
            [
                "dtrt",
                "run",
                "--backend",
                "onnxruntime",
                "--export",
                str(tiny_export.path),
                "--method",
                "ddtree",
                "--threads",
                "1",
                *args,
                "The cat sees ",
            ],
        )
        cli.main()
        return capsys.readouterr()

    text = run()
    assert len(text.out.strip()) > 20 and "tau" in text.err and "tok/s" in text.err
    res = json.loads(run("--model", "tiny", "--json").out)  # --model: the export is checked against it
    assert res["tau"] > 2 and len(res["tokens"]) == 128 and res["text"] == text.out.strip("\n")


@pytest.fixture
def broken(tiny_export, tmp_path):
    """A copy of the export to damage."""
    path = tmp_path / "export"
    shutil.copytree(tiny_export.path, path)
    return path


def edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def expect_cli_error(monkeypatch, capsys, export, *fragments, args=()):
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "run",
        "--backend",
        "onnxruntime",
        "--export",
        str(export),
        "--method",
        "ddtree",
        *args,
        "The cat",
    )
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    for f in fragments:
        assert f in err, err
    return err


def fix(path):
    """The re-export command, with the flags the fixture exported with."""
    flags = "--dtype fp32 --max-context 512 --budget 16 --topm 64 --node-topk 8"
    return f"dtrt export --model tiny {flags} --out {path} --force"


def test_missing_file(broken, monkeypatch, capsys):
    (broken / "weights.data").unlink()
    expect_cli_error(monkeypatch, capsys, broken, str(broken / "weights.data"), "missing", fix(broken))


def test_truncated_file(broken, monkeypatch, capsys):
    f = broken / "dflash.block.onnx"
    f.write_bytes(f.read_bytes()[:1000])
    expect_cli_error(monkeypatch, capsys, broken, str(f), "truncated", fix(broken))


def test_corrupt_graph_same_size(broken, monkeypatch, capsys):
    f = broken / "target.onnx"
    f.write_bytes(b"\xff" * f.stat().st_size)
    expect_cli_error(monkeypatch, capsys, broken, str(f), "its sha256 differs from the manifest's", fix(broken))
    # a manifest rewritten to match (an export written wrong): ONNX Runtime's own refusal
    write_manifest(broken, json.loads((broken / "manifest.json").read_text()))
    expect_cli_error(monkeypatch, capsys, broken, str(f), "ONNX Runtime cannot load it", fix(broken))


def test_other_dtrt_version(broken, monkeypatch, capsys):
    edit_manifest(broken, lambda m: m.update(dtrt_version="0.0.1"))
    expect_cli_error(monkeypatch, capsys, broken, str(broken / "manifest.json"), "dtrt 0.0.1", fix(broken))


def test_export_from_another_model(broken, monkeypatch, capsys):
    edit_manifest(broken, lambda m: m["source"].update(model="qwen3-4b"))
    expect_cli_error(
        monkeypatch,
        capsys,
        broken,
        str(broken / "manifest.json"),
        "'qwen3-4b', not 'tiny'",
        "dtrt export --model tiny --out DIR",
        args=("--model", "tiny"),
    )


def test_export_from_another_target(tiny, broken, tmp_path, monkeypatch, capsys):
    other = tmp_path / "target"
    shutil.copytree(tiny.target, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    expect_cli_error(
        monkeypatch,
        capsys,
        broken,
        str(broken / "manifest.json"),
        f"another target checkpoint than {other}",
        fix(broken),
        args=("--target", str(other)),
    )


def test_no_domino_scorer_stages(broken, monkeypatch, capsys):
    edit_manifest(broken, lambda m: [m["stages"].pop(s, None) for s in SCORER_STAGES])
    expect_cli_error(
        monkeypatch,
        capsys,
        broken,
        str(broken),
        "no Domino scorer stages",
        fix(broken),
        "--arm marg",
        args=("--method", "dominotree"),
    )


def test_block_stage_of_an_older_export(broken, monkeypatch, capsys):
    """An export of layout 11 and before: its block stage computes every row, with no `rows` input (here the graph's
    `rows` made a constant)."""
    import onnx
    from onnx import numpy_helper

    f = broken / "dflash.block.onnx"
    graph = onnx.load(str(f), load_external_data=False)
    graph.graph.input.remove(next(i for i in graph.graph.input if i.name == "rows"))
    graph.graph.initializer.append(numpy_helper.from_array(np.array([7]), "rows"))
    onnx.save(graph, str(f))
    edit_manifest(broken, lambda m: m["stages"]["dflash.block"]["inputs"].remove("rows"))
    write_manifest(broken, json.loads((broken / "manifest.json").read_text()))
    expect_cli_error(monkeypatch, capsys, broken, "its dflash.block stage computes every drafter row", fix(broken))


def test_block_stage_reading_a_stacked_cache(broken, monkeypatch, capsys):
    """An export of layout 15 and before: its block stage reads one draft cache stacked over layers (here the
    first layer's inputs renamed as that input was)."""
    import onnx

    f = broken / "dflash.block.onnx"
    graph = onnx.load(str(f), load_external_data=False)
    renamed = {"cache_k0": "cache_k", "cache_v0": "cache_v"}
    for i in graph.graph.input:
        i.name = renamed.get(i.name, i.name)
    for node in graph.graph.node:
        node.input[:] = [renamed.get(x, x) for x in node.input]
    onnx.save(graph, str(f))
    edit_manifest(
        broken,
        lambda m: m["stages"]["dflash.block"].update(
            inputs=[renamed.get(x, x) for x in m["stages"]["dflash.block"]["inputs"]]
        ),
    )
    write_manifest(broken, json.loads((broken / "manifest.json").read_text()))
    expect_cli_error(monkeypatch, capsys, broken, "its dflash.block stage reads one draft cache stacked", fix(broken))


def test_bad_options(tiny_export, monkeypatch, capsys):
    expect_cli_error(
        monkeypatch, capsys, tiny_export.path, "--max-context", str(tiny_export.path), args=("--max-new-tokens", "600")
    )
    expect_cli_error(monkeypatch, capsys, tiny_export.path, "--dtype fp16", "fp32", args=("--dtype", "fp16"))
    expect_cli_error(monkeypatch, capsys, tiny_export.path, "--threads 0", args=("--threads", "0"))
    target = tiny_export.manifest["source"]["target"]
    code, _, err = run_cli(monkeypatch, capsys, "run", "--backend", "onnxruntime", "--target", target, "x")
    assert code == 2 and "needs --export DIR" in err and err.count("\n") == 1
    code, _, err = run_cli(monkeypatch, capsys, "run", "--backend", "torch", "--export", str(tiny_export.path), "x")
    assert code == 2 and "--export DIR is for --backend onnxruntime" in err and err.count("\n") == 1


def test_export_without_drafter(broken):
    edit_manifest(broken, lambda m: m["drafters"].pop("dflash"))
    with pytest.raises(DtrtError, match="no dflash drafter"):
        OrtBackend(load_export(broken), "dflash")


def test_default_sources():
    from dtrt.launch import resolve_spec
    from dtrt.zoo.registry import DEFAULT_MODEL

    def sources(**flags):
        s = resolve_spec(**flags)
        return s.model, s.backend

    assert sources() == (DEFAULT_MODEL, "onnxruntime")
    assert sources(export="exp") == (None, "onnxruntime")
    assert sources(model="tiny") == ("tiny", "torch")
    assert sources(target="dir") == (None, "torch")
    assert sources(backend="torch") == (DEFAULT_MODEL, "torch")


def test_a_quantized_registry_target_compiles_the_kernel_before_its_conversion(monkeypatch):
    """On first use the compile takes the other core while the model converts and exports, not after."""
    from dtrt.launch import resolve_spec, start
    from dtrt.runtime.backends import ort_ops

    order = []
    monkeypatch.setattr(ort_ops, "build_in_background", lambda: order.append("compile"))

    def converting(spec, log=None):
        order.append("convert")
        raise DtrtError("stop here")

    monkeypatch.setattr(start, "load_pair", converting)
    for quant, want in (("gguf", ["compile", "convert"]), ("int8", ["compile", "convert"]), ("none", ["convert"])):
        order.clear()
        spec = resolve_spec(model="smollm2-135m", backend="onnxruntime", quant=quant)
        with pytest.raises(DtrtError, match="stop here"):
            start.open_sources(spec)
        assert order == want, quant
    order.clear()
    with pytest.raises(DtrtError, match="stop here"):  # the torch backend runs no kernel of dtrt's
        start.open_sources(resolve_spec(model="smollm2-135m", backend="torch"))
    assert order == ["convert"]


def test_cached_export_is_reused_and_remade_when_the_checkpoints_change(
    tiny, tiny_export, tiny_export_int8, tiny_export_int4, tmp_path, monkeypatch
):
    from dtrt import __version__
    from dtrt.launch import first_use as cache
    from dtrt.models.pair import Pair
    from dtrt.runtime.backends import ort_ops

    monkeypatch.setenv("DTRT_CACHE", str(tmp_path))
    cached = tmp_path / "exports" / f"tiny-{__version__}"
    made, builds = [], []
    monkeypatch.setattr(cache, "export_pair", lambda pair, out, cfg, **kw: made.append((pair, out, cfg)) or "new")
    monkeypatch.setattr(ort_ops, "build_in_background", lambda: builds.append(len(made)))
    monkeypatch.setattr(cache, "export_jobs", lambda pair: 2)
    for other in (tiny_export, tiny_export_int4):  # fp32 drafters (an earlier dtrt), or not the registry's choice
        shutil.copytree(other.path, cached)
        logs = []
        assert cache.cached_export(tiny, "tiny", logs.append) == "new"
        assert made[-1][2].drafter_quant == "int8" and any("--drafter-quant int8" in m for m in logs), logs
        assert made[-1][2].jobs == 2  # export_jobs' choice for this machine
        shutil.rmtree(cached)
    made.clear()
    shutil.copytree(tiny_export_int8.path, cached)
    exp = cache.cached_export(tiny, "tiny")
    assert exp.path == cached and not made
    other = tmp_path / "target"
    shutil.copytree(tiny.target, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    logs = []
    assert cache.cached_export(Pair(other, tiny.dflash, tiny.domino), "tiny", logs.append) == "new"
    assert made and any("out of date" in m for m in logs)
    made.clear()
    edit_manifest(cached, lambda m: m.pop("layout"))  # an export of an earlier layout: made again
    logs = []
    assert cache.cached_export(tiny, "tiny", logs.append) == "new" and made
    assert any("made by an earlier dtrt (layout 1)" in m for m in logs)
    # a cache holding only another target configuration (an earlier default) says why it exports again
    made.clear()
    logs = []
    assert not builds  # an fp32 target's sessions run no kernel of dtrt's
    assert cache.cached_export(tiny, "tiny", logs.append, quant="int4") == "new" and made
    why = [m for m in logs if "no export of its int4 target in the cache yet" in m]
    assert len(why) == 1 and f"it holds tiny-{__version__})" in why[0] and "default target is fp32" in why[0]
    assert builds == [0]  # a quantized target's: the kernels' compile started before its export


def test_first_use_takes_the_registrys_subset_per_target(tiny, tiny_export_int8, tmp_path, monkeypatch):
    """A target quantization the registry gives its own subset (a file beside the Domino drafter) is exported with
    it where --draft-vocab is not given, in the same cache directory; a cached export of another subset is remade;
    the drafter's own and an explicit --draft-vocab are untouched."""
    from dtrt import __version__
    from dtrt.artifacts.memo import checkpoint_hashes
    from dtrt.launch import first_use as cache
    from dtrt.models.draft_vocab import DraftVocab
    from dtrt.models.pair import Pair

    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "cache"))
    domino = tmp_path / "domino"
    shutil.copytree(tiny.domino, domino)
    DraftVocab.from_ids(range(64), 128).save(domino / "small.safetensors")
    pair = Pair(tiny.target, tiny.dflash, domino)
    monkeypatch.setattr(
        cache, "default_draft_vocab", lambda model, quant: "small.safetensors" if quant == "int8" else None
    )
    made = []
    monkeypatch.setattr(cache, "export_pair", lambda pair, out, cfg, **kw: made.append((out, cfg)) or "new")
    cached = tmp_path / "cache" / "exports" / f"tiny-{__version__}-int8"
    cached.parent.mkdir(parents=True)
    shutil.copytree(tiny_export_int8.path, cached)  # drafts over the whole vocabulary: not the registry's subset
    # from this drafter directory (its files, the new subset among them, are the drafter checkpoint's)
    edit_manifest(cached, lambda m: m["source"]["drafters"]["domino"].update(hashes=checkpoint_hashes(domino)))
    logs = []
    assert cache.cached_export(pair, "tiny", logs.append, quant="int8") == "new"
    out, cfg = made[-1]
    assert out == cached and cfg.draft_vocab == str(domino / "small.safetensors")
    assert any("draft vocabulary is not" in m for m in logs), logs
    assert cache.cached_export(pair, "tiny", quant="int4") == "new" and made[-1][1].draft_vocab is None
    assert cache.cached_export(pair, "tiny", quant="int8", draft_vocab="full") == "new"
    assert made[-1][1].draft_vocab == "full" and made[-1][0].name == f"tiny-{__version__}-int8-fullvocab"
    # a drafter without the file (a user's own): its own subset
    assert cache.cached_export(tiny, "tiny", quant="int8") == "new" and made[-1][1].draft_vocab is None


# the exported frontier stage


def test_frontier_stage_builds_the_heaps_trees_in_one_call_per_round(tiny_export, torch_tokens, monkeypatch):
    """--builder frontier on ONNX Runtime: each round's tree comes from one call of the domino.frontier stage, and
    on the rounds of real generations it is the tree the host heap builds from the same drafter rows."""
    from dtrt.runtime.backends.exported import FRONTIER_STAGE
    from dtrt.runtime.methods import DominoTree
    from dtrt.tree import build_heap

    draft = spec("dominotree", builder="frontier")
    pipe = ort_pipeline(tiny_export, draft)
    runner, calls = pipe.backend.runner, []
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda stage, feeds: calls.append(stage) or real_run(stage, feeds))
    compared = []
    real_build = DominoTree.build

    def build(self, backend, rnd):
        tree = real_build(self, backend, rnd)
        c = self.cfg
        heap = build_heap(backend.scorer(c.arm, rnd, c.node_topk, c.topm), c.budget, self.max_depth)
        assert torch.equal(tree.tokens, heap.tokens) and torch.equal(tree.parents, heap.parents)
        torch.testing.assert_close(tree.scores, heap.scores, atol=1e-4, rtol=0)
        compared.append(len(tree))
        return tree

    monkeypatch.setattr(DominoTree, "build", build)
    gens = generate_all(pipe)
    assert [g.tokens for g in gens] == torch_tokens
    rounds = sum(len(g.rounds) for g in gens)
    assert calls.count(FRONTIER_STAGE) == rounds == len(compared) > 0
    assert sum(r.accepted for g in gens for r in g.rounds) / rounds > 2


def test_frontier_stage_has_the_exports_budget(tiny_export):
    with pytest.raises(DtrtError, match=r"^--budget 8: the frontier stage of .* was exported with --budget 16; pass"):
        ort_pipeline(tiny_export, spec("dominotree", builder="frontier", budget=8))
    pipe = ort_pipeline(tiny_export, spec("dominotree", builder="frontier", budget=8, arm="marg"))
    assert not pipe.backend.frontier_stage  # the ablation arms build on the host, at any budget


def test_cost_curve_kept_per_export_and_threads(tiny_export, cost_store, monkeypatch):
    from dtrt.runtime import calibrate
    from dtrt.runtime.sampling import SamplingConfig

    draft = spec("cadominotree", budget=8)
    first = ort_pipeline(tiny_export, draft)
    prompt = first.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    first.generate(prompt, 4, SamplingConfig())
    assert len(list(cost_store.glob("*.json"))) == 1
    monkeypatch.setattr(calibrate, "measure_cost_curve", lambda *a: pytest.fail("measured again"))
    again = ort_pipeline(tiny_export, draft)  # another process on this machine, in effect
    again.generate(prompt, 4, SamplingConfig())
    assert again.method.curve == first.method.curve and again.backend.cost_key() == first.backend.cost_key()
    other = pipe_for(None, draft, backend="onnxruntime", export=tiny_export.path, threads=2)
    assert other.backend.cost_key() != first.backend.cost_key()


def test_threads_spin_within_a_call_and_torch_keeps_the_host_to_one(tiny, tiny_export, monkeypatch):
    """On the CPU a session's intra-op threads may spin between its parallel sections and stop when the call returns;
    torch, which runs only the host's small ops beside ONNX Runtime, gets one thread whatever --threads says (its
    idle OpenMP thread would spin on the core ONNX Runtime's second thread needs); the torch backend's models keep
    --threads, and without it get back the threads torch had before. Domino's scorer stages run on one thread: their
    sessions have no pool whose worker would spin as it starts."""
    from dtrt.runtime import pipeline
    from dtrt.runtime.backends.exported import SCORER_STAGES

    monkeypatch.setattr(pipeline, "_torch_threads", 3)  # what torch had before this process's first pipeline
    pipe = pipe_for(None, spec("dominotree"), backend="onnxruntime", export=tiny_export.path, threads=2)
    sessions = pipe.backend.runner.sessions
    assert {"target", "domino.block", "domino.context", *SCORER_STAGES} <= set(sessions)
    for stage, sess in sessions.items():
        opts = sess.get_session_options()
        assert opts.intra_op_num_threads == (1 if stage in SCORER_STAGES else 2), stage
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
        assert opts.get_session_config_entry("session.force_spinning_stop") == "1"
    assert torch.get_num_threads() == 1
    pipe_for(tiny, spec("dominotree"), threads=2)
    assert torch.get_num_threads() == 2
    pipe_for(None, spec("ar"), backend="onnxruntime", export=tiny_export.path)  # no --threads: ONNX Runtime's own
    assert torch.get_num_threads() == 1
    pipe_for(tiny, spec("ar"))  # the torch backend after an exported one, no --threads: torch's own count again
    assert torch.get_num_threads() == 3

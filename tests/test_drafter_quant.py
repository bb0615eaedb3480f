"""`dtrt export --drafter-quant int8|int4`: the drafters' context stages on int4 weights and block stages on int8
ones (int4: the block's lm_head on int4 weights). The output stays the AR tokens with drafts accepted, parity
judges those stages by their own tolerance (and still catches a wrong weight), and the exports that cannot take
them (TensorRT, fp16) say so."""

import json

import numpy as np
import pytest
import torch
from helpers import generate_all, spec
from test_ort_backend import check_speculative, ort_pipeline

from dtrt.artifacts.export import MANIFEST
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import check_drafter_quant
from dtrt.exporter.quantize import quantized_stages
from dtrt.exporter.reference import TorchStageRunner, reference_stages
from dtrt.parity.check import (
    INT4_TOLERANCE,
    QUANT_TOLERANCE,
    TOLERANCES,
    compare_stage,
    random_cases,
    real_tolerance,
    run_parity,
)
from dtrt.runtime.backends.onnxruntime import OrtRunner


def int4_weights(graph) -> tuple[list[str], list]:
    """The inputs of the products on int4 weights (DequantizeLinear -> MatMul), and the int8 products."""
    from onnx import TensorProto

    int4 = {i.name for i in graph.initializer if i.data_type == TensorProto.INT4}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int4}
    readers = [n.input[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in dequantized]
    return readers, [n for n in graph.node if n.op_type == "MatMulInteger"]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_the_drafter_stages_and_what_each_quantizes(request, quant):
    """Both: the context stages' products on int4 weights, the block's draft layers on int8 ones; int8 the block's
    lm_head int8 too, int4 the lm_head (the product that reads the proposal rows) on int4 weights. No other stage
    changes."""
    import onnx

    exp = request.getfixturevalue(f"tiny_export_{quant}")
    m = exp.manifest
    assert m["quantized_stages"] == ["dflash.context", "dflash.block", "domino.context", "domino.block"]
    assert quantized_stages(["target", "dflash.context", "domino.block", "domino.scorer_root"], "none") == []
    assert f"--drafter-quant {quant}" in exp.fix_hint()
    for name in m["stages"]:
        graph = onnx.load(str(exp.stage(name)), load_external_data=False).graph
        readers, integer = int4_weights(graph)
        if name.endswith(".context"):
            assert readers and not integer and not any(n.op_type == "Gemm" for n in graph.node), name
        elif name.endswith(".block"):
            assert integer and readers == (["head_rows"] if quant == "int4" else []), (name, readers)  # head_even_rows
        else:
            assert not readers and not integer, name


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize(
    "draft",
    [spec("dflash"), spec("dominotree"), spec("dominotree", builder="frontier")],
    ids=lambda d: d.method + d.builder,
)
def test_quantized_drafter_keeps_the_ar_tokens_with_drafts_accepted(request, torch_tokens, draft, quant):
    check_speculative(ort_pipeline(request.getfixturevalue(f"tiny_export_{quant}"), draft), draft, torch_tokens)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["dflash", "domino"])
def test_quantized_rows_are_those_of_every_row(request, kind, quant):
    """A row's base logits are the same bits whatever `rows` a round asks for: the int8 lm_head's activations are
    quantized over every proposal row (a scale over the rows asked alone would move them), the int4 one's row by
    row."""
    from dtrt.runtime.backends.onnxruntime import OrtBackend

    exp = request.getfixturevalue(f"tiny_export_{quant}")
    backend = OrtBackend(exp, kind, threads=1)
    backend.reset(32)
    n, gen = 11, torch.Generator().manual_seed(0)
    ids = torch.randint(0, exp.manifest["target"]["vocab_size"], (n,), generator=gen)
    _, hidden = backend.target_forward(ids, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    backend.commit(torch.arange(n))
    backend.draft_context(hidden, torch.arange(n))
    k_draft = backend.drafter.cfg.k_draft
    full = [x.clone() for x in backend.draft_block(5, n, rows=k_draft)]
    for rows in (1, 2, k_draft - 1):
        ph, base = backend.draft_block(5, n, rows=rows)
        assert torch.equal(ph, full[0][:rows]) and torch.equal(base, full[1][:rows]), rows


def test_quantized_drafts_stay_close_to_the_fp32_ones(tiny_export, tiny_export_int8, tiny_export_int4):
    """Same prompts, same target: acceptance moves little (the drafts are the fp32 ones up to rounding)."""
    taus = []
    for exp in (tiny_export, tiny_export_int8, tiny_export_int4):
        gens = generate_all(ort_pipeline(exp, spec("dominotree")))
        rounds = [r.accepted for g in gens for r in g.rounds]
        taus.append(sum(rounds) / len(rounds))
    assert taus[1] > 0.8 * taus[0] and taus[2] > 0.8 * taus[0], taus


def test_parity_judges_quantized_stages_by_their_tolerance(tiny_export_int8):
    stages = {k: v for k, v in reference_stages(tiny_export_int8).items() if k.endswith(".block") or k == "target"}
    report = run_parity(tiny_export_int8, 1, stages=stages)
    assert report.ok, report.table()
    assert report.quantized == ("dflash.context", "dflash.block", "domino.context", "domino.block")
    assert (
        "quantized drafter stages" in report.table()
        and report.to_json()["quantized"]["domino.block"]["cosine"] == QUANT_TOLERANCE.cosine
        and report.to_json()["quantized"]["domino.context"]["cosine"] == INT4_TOLERANCE.cosine
    )
    # a wrong weight in the reference is still caught at that tolerance
    o_proj = stages["domino.block"].module.drafter.layers[0].self_attn.o_proj.weight
    with torch.no_grad():
        o_proj.copy_(torch.randn_like(o_proj) * o_proj.std())
    bad = run_parity(tiny_export_int8, 0, stages={"domino.block": stages["domino.block"]})
    assert bad.failed == ["domino.block"], bad.table()


def test_parity_judges_int4_drafter_stages_by_their_tolerance(tiny_export_int4):
    wanted = ("target", "domino.block", "domino.context")
    stages = {k: v for k, v in reference_stages(tiny_export_int4).items() if k in wanted}
    report = run_parity(tiny_export_int4, 1, stages=stages)
    assert report.ok, report.table()
    assert report.quantized == ("dflash.context", "dflash.block", "domino.context", "domino.block")
    assert {r.stage for r in report.rows} == set(wanted)
    assert report.to_json()["quantized"]["domino.context"]["cosine"] == INT4_TOLERANCE.cosine
    assert report.to_json()["quantized"]["domino.block"]["cosine"] == INT4_TOLERANCE.cosine
    fc = stages["domino.context"].module.drafter.fc.weight
    with torch.no_grad():
        fc.copy_(torch.randn_like(fc) * fc.std())
    bad = run_parity(tiny_export_int4, 0, stages={"domino.context": stages["domino.context"]})
    assert bad.failed == ["domino.context"], bad.table()


def test_exports_that_cannot_take_int8_drafters(tiny_export_int8):
    with pytest.raises(DtrtError, match="--drafter-quant int8 .* --dtype fp32"):
        check_drafter_quant("int8", "fp16")
    with pytest.raises(DtrtError, match="--drafter-quant int4 .* --dtype fp32"):
        check_drafter_quant("int4", "bf16")
    with pytest.raises(DtrtError, match="--drafter-quant 'int2'"):
        check_drafter_quant("int2", "fp32")
    from dtrt.engines.build import build_engines

    with pytest.raises(
        DtrtError,
        match=r"quantized weights .* ONNX Runtime only; for TensorRT re-export with "
        r"`dtrt export --model tiny .*--drafter-quant none",
    ):
        build_engines(tiny_export_int8.path, tiny_export_int8.path.parent / "engines")
    assert json.loads((tiny_export_int8.path / MANIFEST).read_text())["drafter_quant"] == "int8"


def test_int8_weights_cannot_saturate_without_vnni(tiny_export_int8):
    """7-bit weights: a CPU without VNNI sums uint8 x int8 pairs in int16, which no pair can overflow."""
    import onnx
    from onnx import numpy_helper

    checked = 0
    for name in tiny_export_int8.manifest["quantized_stages"]:
        graph = onnx.load(str(tiny_export_int8.stage(name))).graph
        inits = {i.name: i for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "MatMulInteger" and node.input[1] in inits:
                w = numpy_helper.to_array(inits[node.input[1]]).astype(int)
                assert 2 * 255 * np.abs(w).max() <= 32767, (name, node.name, np.abs(w).max())
                checked += 1
    assert checked >= 2


def test_real_inputs_of_int8_stages_may_tie(tiny_export_int8):
    """The scorer's real inputs are the int8 block's logits, which tie; a top-k over ties may order them either
    way, so parity accepts integer outputs that differ there (random inputs stay strict)."""
    quantized = tuple(tiny_export_int8.manifest["quantized_stages"])
    strict = TOLERANCES["fp32"]
    assert real_tolerance(strict, quantized).ties and not real_tolerance(strict, ()).ties
    stage = reference_stages(tiny_export_int8)["domino.scorer_setup"]
    _, feed = random_cases(stage, True)[0]
    feed = dict(feed, base=torch.zeros_like(feed["base"]))  # every candidate tied
    rows = compare_stage(
        "domino.scorer_setup",
        OrtRunner(tiny_export_int8),
        TorchStageRunner(tiny_export_int8, {"domino.scorer_setup": stage}),
        [("tied", feed)],
        real_tolerance(strict, quantized),
    )
    assert all(r.ok for r in rows), rows

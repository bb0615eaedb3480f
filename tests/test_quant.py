"""`dtrt export --quant int8|int4`: the target's linear layers weight-only quantized. The quantization math, the
exported form (DequantizeLinear -> MatMul, the ordered attention), every method equal to the same export's AR at
T=0 with drafts accepted (across an aligned attention block too), parity against the dequantized reference (and a
corrupted integer caught), the order check (and the plain attention it exists for caught), and the errors."""

import json
import shutil

import numpy as np
import onnx
import onnxscript
import pytest
import torch
from helpers import PROMPTS, generate_all, pipe_for, run_cli, spec
from test_ort_backend import ort_pipeline

from dtrt.artifacts.export import load_export
from dtrt.artifacts.files import MANIFEST, write_manifest
from dtrt.artifacts.kernel_path import this_path
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.reference import TorchStageRunner, reference_stages
from dtrt.exporter.target_quant import DATA_SUFFIX, pack_int4, unpack_int4
from dtrt.exporter.write import export_pair
from dtrt.models.checkpoint import load_target
from dtrt.models.quant import dequantize, quantize
from dtrt.models.quant_spec import QuantSpec, quant_spec
from dtrt.parity import run_parity
from dtrt.parity.quantized import order_check
from dtrt.runtime.backends.exported import pad_rows, pairs_rows, target_rows
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree.tree import Tree
from dtrt.zoo.registry import tiny_hybrid_pair

INT4 = quant_spec("int4")


@pytest.fixture(scope="module")
def int4_export(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "tiny-int4"
    return export_pair(tiny, path, ExportConfig(max_context=512, drafters=("domino",), quant="int4"), model="tiny")


@pytest.fixture(scope="module")
def int8_export(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "tiny-int8"
    return export_pair(tiny, path, ExportConfig(max_context=256, drafters=("domino",), quant="int8"), model="tiny")


@pytest.fixture(scope="module")
def int4_ar(int4_export):
    return [g.tokens for g in generate_all(ort_pipeline(int4_export, spec("ar")))]


# quantization math
@pytest.mark.parametrize("q", [quant_spec("int8", method="rtn"), quant_spec("int4", 32, "rtn")], ids=["int8", "int4"])
def test_round_to_nearest_is_within_half_a_step(q):
    w = torch.randn(24, 80)  # 80 = 2 blocks of 32 and a last one of 16
    ints, scale = quantize(w, q)
    assert ints.dtype == torch.int8 and ints.shape == w.shape
    assert scale.shape == ((24, 1) if q.bits == 8 else (24, 3))
    lo, hi = (-128, 127) if q.bits == 8 else (-8, 7)
    assert ints.min() >= lo and ints.max() <= hi
    step = scale.repeat_interleave(80 if q.bits == 8 else 32, dim=1)[:, :80]
    assert ((dequantize(ints, scale, q) - w).abs() <= step / 2 + 1e-7).all()
    assert ints.abs().amax() == (127 if q.bits == 8 else 7)  # absmax of each group maps to qmax


def test_mse_clipping_lowers_the_weight_error_and_is_deterministic():
    w = torch.randn(64, 96) * torch.rand(64, 1)
    w[0, 0] = 40.0  # an outlier: clipping pays
    err = {}
    for method in ("rtn", "mse"):
        s = QuantSpec(bits=4, block=32, method=method)
        q, scale = quantize(w, s)
        err[method] = (dequantize(q, scale, s) - w).square().sum()
        q2, scale2 = quantize(w.clone(), s)
        assert torch.equal(q, q2) and torch.equal(scale, scale2)
    assert err["mse"] < err["rtn"]


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_products_of_one_activation_merge_bit_for_bit(quant, tmp_path):
    """Products reading one activation become one quantized product and a Split; under ONNX Runtime's fused kernels
    (int8 activations) every output equals the separate products' bit for bit. A weight that two products read
    (a tied one) stays alone."""
    from onnx import TensorProto, helper, numpy_helper

    from dtrt.exporter.target_quant import quantize_target
    from dtrt.runtime.backends.onnxruntime import cpu_session

    rng = np.random.default_rng(0)
    widths = (64, 32, 32, 64)  # y3 reads w0 again
    weights = [numpy_helper.from_array(rng.standard_normal((96, w)).astype(np.float32), f"w{i}") for i, w in
               enumerate(widths[:3])]  # fmt: skip

    def model(path, shared: bool):
        reads = ["x"] * 4 if shared else ["x", "x1", "x2", "x3"]  # an Identity apart: another activation
        nodes = [helper.make_node("Identity", ["x"], [r]) for r in reads[1:] if not shared]
        nodes += [helper.make_node("MatMul", [r, f"w{i % 3}"], [f"y{i}"], name=f"mm{i}") for i, r in enumerate(reads)]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 96])
        ys = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["n", w]) for i, w in enumerate(widths)]
        path.parent.mkdir()
        graph = helper.make_graph(nodes, "g", [x], ys, weights)
        onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
        return quantize_target(path, quant_spec(quant), [(f"w{i}",) for i in range(3)])

    merged_path, alone_path = tmp_path / "merged" / "m.onnx", tmp_path / "alone" / "m.onnx"
    assert model(merged_path, shared=True) == (["w0", "w1", "w2"], 3)  # w0 twice alone, w1 + w2 merged
    assert model(alone_path, shared=False) == (["w0", "w1", "w2"], 4)
    x = (rng.standard_normal((5, 96)) * 3).astype(np.float32)
    merged = cpu_session(merged_path, threads=1).run(None, {"x": x})
    alone = cpu_session(alone_path, threads=1).run(None, {"x": x})
    for m, a in zip(merged, alone):
        assert m.shape == a.shape and np.array_equal(m, a)
    assert np.array_equal(merged[0], merged[3])


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (7, 5), dtype=torch.int8).numpy()  # odd count: the last byte half full
    raw = pack_int4(q)
    assert len(raw) == 18 and np.array_equal(unpack_int4(raw, q.size).reshape(q.shape), q)
    assert pack_int4(np.array([-1, 2], np.int8)) == bytes([0x2F])  # first value in the low nibble


def test_quant_flags_are_checked():
    assert quant_spec("none") is None and quant_spec("int8").block is None
    with pytest.raises(ValueError, match="--quant-block 48: use one of 32, 64, 128"):
        quant_spec("int4", 48)
    with pytest.raises(ValueError, match="--quant-method 'gptq'"):
        quant_spec("int4", method="gptq")


# the export
@pytest.mark.slow
def test_quantized_export_holds_dequantize_matmul_and_ordered_attention(int4_export):
    m = int4_export.manifest
    layers = m["target"]["num_layers"]
    assert m["quant"] == {"bits": 4, "block": 32, "method": "rtn", "format": "qdq", "weights": 7 * layers + 1,
                          "products": 4 * layers + 1}  # fmt: skip
    # q, k, v, o, gate, up, down and the lm_head; q/k/v and gate/up read one activation each: one product each
    assert m["ordered_attention"] == {"align": 128, "max_rows": 64, "min_rows": 2}
    assert int4_export.quant == INT4 and int4_export.quant_name == "int4"
    assert "--quant int4 --quant-block 32" in int4_export.fix_hint()
    assert "--quant" not in int4_export.fix_hint(quant="none")
    assert "--quant int8 --out" in int4_export.fix_hint(quant="int8")  # per channel: no block
    graph = onnx.load(str(int4_export.stage("target")), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == m["quant"]["products"]
    qkv = inits[next(n.input[0] for n in dq if ".q_proj." in n.input[0])]
    o_proj = inits[next(n.input[0] for n in dq if ".o_proj." in n.input[0])]  # [heads * head_dim, hidden]
    kv = m["target"]["num_kv_heads"] * m["target"]["head_dim"]
    assert qkv.dims[1] == o_proj.dims[0] + 2 * kv  # q, k and v side by side
    for n in dq:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert inits[n.input[0]].data_type == onnx.TensorProto.INT4 and len(n.input) == 2  # symmetric: no zero point
        assert attrs == {"axis": 0, "block_size": 32}
    scales = {n.input[1] for n in dq}
    floats = [i for i in inits.values() if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2]
    vocab, hidden = m["target"]["vocab_size"], m["target"]["hidden_size"]
    assert [list(i.dims) for i in floats if i.name not in scales] == [[vocab, hidden]]  # the embedding, for the lookup
    ops = {n.op_type for n in graph.node}
    assert "TreeAttention" not in ops and "Gemm" not in ops
    planned = [n for n in graph.node if n.op_type == "TreeAttentionPlanned"]
    plans = [n for n in graph.node if n.op_type == "TreeAttentionOrderPlan"]
    assert len(planned) == m["target"]["num_layers"] and len(plans) == 1  # the plan once, read by every layer
    assert all(list(n.input[7:]) == list(plans[0].output) and n.input[6] == "attention.scale" for n in planned)
    # no layer joins or slices its past: each reads the K and V caches themselves, at its own layer
    assert {n.op_type for n in graph.node if "past_v" in n.input} == {"TreeAttentionPlanned"}
    assert {n.op_type for n in graph.node if "past_k" in n.input} == {"TreeAttentionPlanned", "TreeAttentionOrderPlan"}
    assert all(n.input[1] == "past_k" and n.input[3] == "past_v" for n in planned)
    assert sorted(int(onnx.numpy_helper.to_array(inits[n.input[4]])[0]) for n in planned) == list(range(layers))
    producers = {o: n.op_type for n in graph.node for o in n.output}
    assert all(producers.get(n.input[1]) != "Concat" and producers.get(n.input[5]) != "Concat" for n in planned)
    body = next(f for f in onnx.load(str(int4_export.stage("target")), load_external_data=False).functions
                if f.name == "TreeAttentionPlanned")  # fmt: skip
    assert "ReduceSum" in {n.op_type for n in body.node}  # the head's weights summed over its columns
    # every rotation (q and k, after the per-head norms) one RotaryEmbedding; no half-turn Gather left
    assert [n.op_type for n in graph.node].count("RotaryEmbedding") == 2 * layers
    assert all(n.input[0] in inits for n in graph.node if n.op_type == "Gather")  # the embedding lookup only
    locations = {e.value for n in dq for e in inits[n.input[0]].external_data if e.key == "location"}
    assert locations == {"weights.data"} and not (int4_export.path / ("target.onnx" + DATA_SUFFIX)).exists()


@pytest.mark.parametrize(
    "draft",
    [spec("dominotree"), spec("dominotree", builder="frontier"), spec("ddtree"), spec("dflash"), spec("domino")],
    ids=lambda d: d.method + ("/" + d.builder if d.method == "dominotree" else ""),
)
@pytest.mark.slow
def test_every_method_gives_the_quantized_ar_tokens_with_drafts_accepted(int4_export, int4_ar, draft):
    gens = generate_all(ort_pipeline(int4_export, draft))
    assert [g.tokens for g in gens] == int4_ar
    rounds = [r for g in gens for r in g.rounds]
    assert sum(r.accepted for r in rounds) / len(rounds) > 2


@pytest.mark.slow
def test_trees_stay_inside_the_aligned_block_across_its_boundary(int4_export):
    """A 200-token generation crosses position 128 with drafts that reach past it: every verify keeps its rows inside
    the 128-aligned block of its past (where plain decoding sums the same columns), the trees that crossed it are
    cut there, and DominoTree still gives the AR tokens. The drafter runs each round as always, but the tree verified
    is AR's own next 8 tokens, the last two made wrong: each round commits 7 tokens, so some round starts within 8
    of the boundary and its chain crosses it, whatever the drafter would have proposed on this CPU."""
    depth = 8
    prompt = ort_pipeline(int4_export, spec("ar")).tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    ar = ort_pipeline(int4_export, spec("ar")).generate(prompt, 200, SamplingConfig()).tokens
    assert len(prompt) + depth < 128 and len(ar) == 200
    pipe = ort_pipeline(int4_export, spec("dominotree"))
    vocab = pipe.backend.export.manifest["target"]["vocab_size"]
    proposed, verified = [], []

    def oracle(root: int) -> Tree:
        start = pipe.backend.past
        i = start - len(prompt)  # the root is AR's token i
        assert ar[i] == root
        nxt = ar[i + 1 : i + 1 + depth]
        chain = nxt[: depth - 2] + [(t + 1) % vocab for t in nxt[depth - 2 :]]
        proposed.append((start, len(chain)))
        return Tree.chain(chain, root=root)

    draft = pipe.method.draft

    def draft_then_oracle(backend, root, start):
        _, drafted = draft(backend, root, start)
        return oracle(root), drafted

    pipe.method.draft, pipe.method.undrafted = draft_then_oracle, oracle
    forward = pipe.backend.target_forward

    def spy(ids, positions, mask):
        verified.append(torch.as_tensor(positions).clone())
        return forward(ids, positions, mask)

    pipe.backend.target_forward = spy
    gen = pipe.generate(prompt, 200, SamplingConfig())
    assert gen.tokens == ar
    verifies = verified[1:]  # after the prefill
    assert [int(p[0]) for p in verifies] == [s for s, _ in proposed]
    crossed = [k for k, (s, n) in enumerate(proposed) if s < 128 <= s + n]
    assert crossed and all(len(verifies[k]) < proposed[k][1] + 1 for k in crossed)  # such trees were cut
    assert all(p.max() // 128 == p[0] // 128 for p in verifies)
    assert sum(r.accepted for r in gen.rounds) / len(gen.rounds) > 2


def test_tree_within_keeps_ancestors_and_reindexes():
    t = Tree.from_parents(torch.tensor([5, 6, 7, 8, 9]), [-1, 0, 1, 0, 3])  # 0 -> 1 -> 2, 0 -> 3 -> 4
    cut = t.within(1)
    assert cut.tokens.tolist() == [5, 6, 8] and cut.parents.tolist() == [-1, 0, 0]
    assert cut.mask.tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert t.within(2) is t and len(t.within(0)) == 1
    chain = Tree.chain([1, 2, 3], root=0)  # as deep as it has draft nodes: returned as is only when it fits
    assert chain.within(3) is chain and chain.within(2).tokens.tolist() == [0, 1, 2]


def test_pad_rows_repeats_the_last_row_seeing_itself():
    ids, pos, mask = pad_rows(torch.tensor([4]), torch.tensor([9]), torch.ones(1, 1, dtype=torch.bool), 2)
    assert ids.tolist() == [4, 4] and pos.tolist() == [9, 9] and mask.tolist() == [[True, False], [False, True]]


def test_torch_backend_runs_the_dequantized_target(tiny):
    pipe = pipe_for(tiny, spec("ar", quant="int4"))
    ar = generate_all(pipe, max_new=24)
    tree = generate_all(pipe_for(tiny, spec("dominotree", quant="int4")), max_new=24)
    assert [g.tokens for g in tree] == [g.tokens for g in ar]
    full = load_target(tiny.target)
    for name in ("lm_head", "model.layers.0.mlp.down_proj"):
        w, ref = pipe.backend.target.get_submodule(name).weight, full.get_submodule(name).weight
        assert torch.equal(w, dequantize(*quantize(ref, INT4), INT4)) and not torch.equal(w, ref)
    assert full.model.embed_tokens.weight is not full.lm_head.weight or torch.equal(
        pipe.backend.target.model.embed_tokens.weight, full.model.embed_tokens.weight
    )  # the embedding stays full precision


# parity
@pytest.mark.slow
def test_parity_passes_and_a_corrupted_integer_fails(int4_export, tmp_path):
    stages = {"target": reference_stages(int4_export)["target"]}
    report = run_parity(int4_export, 1, stages=stages)
    assert report.ok, report.table()
    cases = {r.case for r in report.rows}
    assert any(c.endswith(", int8 activations") for c in cases) and any("tree = plain decoding" in c for c in cases)
    assert all(r.max_abs == 0.0 for r in report.rows if "tree = plain decoding" in r.case)
    assert "int4 target" in report.table() and report.to_json()["target_quant"] == "int4"
    # one int4 weight's integers rewritten in the export: its own parity fails, at fp32 activations too
    bad = tmp_path / "bad"
    shutil.copytree(int4_export.path, bad)
    graph = onnx.load(str(bad / "target.onnx"), load_external_data=False).graph
    q = next(i for i in graph.initializer if i.name.endswith("down_proj.weight.q4"))
    info = {e.key: e.value for e in q.external_data}
    with open(bad / info["location"], "r+b") as f:
        f.seek(int(info["offset"]))
        f.write(bytes(255 - b for b in f.read(int(info["length"]))))
    write_manifest(bad, json.loads((bad / MANIFEST).read_text()))  # for parity to find, not the file hashes
    report = run_parity(load_export(bad), 0, stages=stages)
    assert report.failed == ["target"]
    assert any(not r.ok for r in report.rows if "activations" not in r.case and "tree" not in r.case)


@pytest.mark.slow
def test_prefills_take_the_whole_row_as_their_head(int4_export):
    """A call of more than max_rows rows (a prefill) runs the same per-layer ops as a verify, its plan putting the
    head's end at the last column (an empty tail): it matches the dequantized reference like every other call."""
    from dtrt.parity.check import QWEIGHT_TOLERANCE, compare_stage
    from dtrt.runtime.backends.onnxruntime import OrtRunner

    stage = reference_stages(int4_export)["target"]
    assert int4_export.manifest["ordered_attention"]["max_rows"] < 70
    cases = [(f"N=70 P={p}", stage.example(70, p, torch.Generator().manual_seed(p))) for p in (0, 150)]
    runner, reference = OrtRunner(int4_export, accuracy=0), TorchStageRunner(int4_export, {"target": stage})
    rows = compare_stage("target", runner, reference, cases, QWEIGHT_TOLERANCE)
    assert len(rows) == 2 * len(stage.outputs) and all(r.ok for r in rows), rows
    model = onnx.load(str(int4_export.stage("target")), load_external_data=False)
    (planned,) = [f for f in model.functions if f.name == "TreeAttentionPlanned"]
    assert "If" not in {n.op_type for n in planned.node}  # one path for every call: no If per layer


def test_an_odd_tree_is_padded_to_even_rows_where_int4_products_pair_them(tiny, int4_export, tmp_path, monkeypatch):
    """At --quant-block 64 ONNX Runtime's int4 product computes rows in pairs and an odd last row in another kernel:
    the runtime pads every quantized target call to an even number of rows (target_rows), so a chain of an odd
    number of nodes verifies to plain decoding's rows bit for bit; with the old padding (to min_rows only) the order
    check sees the last row differ."""
    import dtrt.parity.quantized as quantized

    exp = export_pair(
        tiny, tmp_path / "q64", ExportConfig(max_context=256, drafters=("dflash",), quant="int4", quant_block=64)
    )
    assert pairs_rows(exp) and not pairs_rows(int4_export)  # blocks of 64 pair rows, 32 (the default) does not
    assert [target_rows(n, 2, True) for n in range(1, 6)] == [2, 2, 4, 4, 6] and target_rows(3, 2) == 3
    rows = order_check(exp)
    assert any(case.startswith("odd chain") for case, *_ in rows)
    assert all(np.array_equal(want, got) for _, _, want, got in rows)
    monkeypatch.setattr(quantized, "pairs_rows", lambda exp: False)
    odd = [np.array_equal(want, got) for case, _, want, got in order_check(exp) if case.startswith("odd chain")]
    # the lone row's kernel differs on the AVX-512 paths; on an AVX2-only CPU this check's odd chains came out equal
    if this_path() in ("amx", "avx512-vnni", "avx512"):
        assert not all(odd)
    trees = generate_all(ort_pipeline(exp, spec("ddtree", budget=2)))  # 3-node trees: padded to 4 rows
    assert [g.tokens for g in trees] == [g.tokens for g in generate_all(ort_pipeline(exp, spec("ar")))]
    assert sum(g.tau for g in trees) / len(trees) > 1.2  # drafts accepted


@pytest.mark.slow
def test_order_check_catches_plain_attention(int4_export, tmp_path, monkeypatch):
    """The same layers with the plain formulation (the past and new values joined, one Softmax) in place of the
    ordered attention: its tree rows differ from plain decoding's, and the order check says so."""
    monkeypatch.setenv("DTRT_ORT_OPS", "0")  # the function body runs (the kernel would replace it)
    from onnxscript import opset20 as op

    from dtrt.ops.functions.opset import OPSET

    @onnxscript.script(OPSET, default_opset=op)
    def TreeAttentionPlanned(q, k_cache, k_new, v_cache, layer, v_new, scale, mask_g, qg_shape, out_shape, ones_tail,
                             b0, b0p, hnew, head_end, tail_start, tail_end, order, order_g, tail_shape, acc_shape, hd,
                             hd1):  # fmt: skip
        axes, zero = op.Constant(value_ints=[0, 2]), op.Constant(value_ints=[0])
        v_past = op.Squeeze(op.Slice(v_cache, layer, op.Add(tail_end, layer), axes), zero)
        k_past = op.Squeeze(op.Slice(k_cache, layer, op.Add(tail_end, layer), axes), zero)
        k = op.Concat(k_past, k_new, axis=1)
        scores = op.Mul(op.MatMul(op.Reshape(q, qg_shape), op.Transpose(k, perm=[0, 2, 1])), scale)
        scores = op.Where(mask_g, scores, op.CastLike(op.Constant(value_float=-1e30), q))
        return op.Reshape(op.MatMul(op.Softmax(scores, axis=-1), op.Concat(v_past, v_new, axis=1)), out_shape)

    plain = tmp_path / "plain"
    shutil.copytree(int4_export.path, plain)
    model = onnx.load(str(plain / "target.onnx"), load_external_data=False)
    body = TreeAttentionPlanned.to_function_proto()
    del body.value_info[:]
    (i,) = [i for i, f in enumerate(model.functions) if f.name == "TreeAttentionPlanned"]
    model.functions[i].CopyFrom(body)
    onnx.save_model(model, str(plain / "target.onnx"))
    write_manifest(plain, json.loads((plain / MANIFEST).read_text()))
    diffs = [np.abs(want - got).max() for _, _, want, got in order_check(load_export(plain))]
    assert max(diffs) > 0
    assert all(np.abs(want - got).max() == 0 for _, _, want, got in order_check(int4_export))


@pytest.mark.slow
def test_int8_export_passes_parity_and_keeps_its_ar_tokens(int8_export):
    m = int8_export.manifest
    assert m["quant"]["bits"] == 8 and m["quant"]["block"] is None
    graph = onnx.load(str(int8_export.stage("target")), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(inits[n.input[0]].data_type == onnx.TensorProto.INT8 for n in dq)
    report = run_parity(int8_export, 0, stages={"target": reference_stages(int8_export)["target"]})
    assert report.ok, report.table()
    ar = [g.tokens for g in generate_all(ort_pipeline(int8_export, spec("ar")), max_new=32)]
    gens = generate_all(ort_pipeline(int8_export, spec("dominotree")), max_new=32)
    assert [g.tokens for g in gens] == ar
    assert sum(r.accepted for g in gens for r in g.rounds) / sum(len(g.rounds) for g in gens) > 2


# errors
@pytest.mark.slow
def test_quantized_exports_refuse_what_they_cannot_do(int4_export, tmp_path, monkeypatch, capsys):
    with pytest.raises(
        DtrtError, match=r"^--quant int8: .* holds an int4 target; drop --quant or re-export with `dtrt"
    ):
        pipe_for(None, spec("ar", quant="int8"), backend="onnxruntime", export=int4_export.path)
    with pytest.raises(DtrtError, match=r"^--budget 64: .* at most 64 nodes; use --budget 63 or less$"):
        pipe_for(None, spec("dominotree", budget=64), backend="onnxruntime", export=int4_export.path)
    with pytest.raises(DtrtError, match=r"^--quant int4: .* is a hybrid target .*; export it with --quant none$"):
        export_pair(tiny_hybrid_pair(), tmp_path / "h", ExportConfig(quant="int4"))
    from dtrt.engines.build import build_engines

    with pytest.raises(DtrtError, match=r"int4 weights .* ONNX Runtime only .* re-export with `dtrt export .*"):
        build_engines(int4_export.path, tmp_path / "engines")
    code, out, err = run_cli(
        monkeypatch, capsys, "export", "--model", "tiny", "--quant", "int4", "--quant-block", "48", "--out",
        str(tmp_path / "x"),
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "--quant-block 48: use one of 32, 64, 128" in err
    assert not (tmp_path / "x").exists()
    code, out, err = run_cli(monkeypatch, capsys, "export", "--model", "tiny", "--quant", "int3", "--out", "y")
    assert code == 2 and "int3" in err and err.count("\n") == 1


@pytest.mark.slow
def test_quality_reports_agreement_and_nll_per_quantization(tiny_export, int8_export, int4_export, monkeypatch, capsys):
    paths = [str(e.path) for e in (tiny_export, int8_export, int4_export)]
    code, out, err = run_cli(
        monkeypatch, capsys, "quality", *(a for p in paths for a in ("--export", p)),
        "--datasets", "humaneval,mt-bench", "--texts", "2", "--max-tokens", "64", "--threads", "1", "--json",
        "--prompts", "2", "--max-new-tokens", "40",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    rows = {(r["quant"].split()[0], r["dataset"]): r for r in result["rows"]}
    assert result["reference"].startswith("none") and len(rows) == 6
    for dataset in ("humaneval", "mt-bench"):
        none, int8, int4 = (rows[q, dataset] for q in ("none", "int8", "int4"))
        assert none["agreement"] == 1.0 and none["texts"] == 2 and none["tokens"] == int4["tokens"] == 2 * 63
        assert 0.5 < int4["agreement"] <= int8["agreement"] <= 1.0 and int4["agreement"] < 1.0
        assert all(np.isfinite(r["nll"]) and r["nll"] > 0 for r in (none, int8, int4))
        # free-running: the reference against itself is identical and passes the gate; int4 differs somewhere
        assert none["answers"] == 2 and none["identical"] == 1.0 and none["new_loops"] == 0 and none["gate"] == []
        assert none["nll_delta"] == 0.0 and int4["gate"] and int4["ar_tok_s"] > 0
    assert min(rows[q, d]["identical"] for q in ("int4",) for d in ("humaneval", "mt-bench")) < 1.0
    code, out, err = run_cli(monkeypatch, capsys, "quality", "--export", paths[0], "--datasets", "math500")
    assert code == 2 and err.count("\n") == 1 and "dtrt quality scores text of humaneval, mt-bench" in err


@pytest.mark.slow
def test_onnx_runtime_fuses_every_quantized_linear(int4_export, int8_export, tmp_path):
    """Every DequantizeLinear -> MatMul pair becomes MatMulNBits at session load (none left dequantizing on every
    call), and RMSNorm fuses too."""
    from dtrt.runtime.backends.onnxruntime import cpu_session

    for exp in (int4_export, int8_export):
        cpu_session(exp.stage("target"), threads=1, optimized=tmp_path / "opt.onnx")
        ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node]
        assert ops.count("MatMulNBits") == exp.manifest["quant"]["products"], exp.quant_name
        assert "DequantizeLinear" not in ops and "Gemm" not in ops and "SimplifiedLayerNormalization" in ops


@pytest.mark.slow
def test_fp16_quantized_export_runs_its_parity(tiny, tmp_path):
    """An fp16 export with an int8 target (what a 4B model needs to fit a 24 GB CPU machine): the whole of `dtrt
    parity`, the order check feeding its fp16 past included."""
    cfg = ExportConfig(max_context=256, drafters=("dflash",), dtype="fp16", quant="int8")
    exp = export_pair(tiny, tmp_path / "fp16-int8", cfg, model="tiny")
    report = run_parity(exp, 0, quick=True)
    assert report.ok, report.table()
    assert any("tree = plain decoding" in r.case and r.max_abs == 0.0 for r in report.rows)
    # its weights are judged at fp16's tolerance where that is looser than the fp32 export's weight check
    assert report.to_json()["weight_tolerance"] == {"cosine": 0.9999, "rel": 2e-2, "ties": True}


def _kernel():
    from dtrt.runtime.backends import ort_ops

    if ort_ops.library() is None:
        pytest.skip(f"dtrt's ONNX Runtime kernel: {ort_ops.unavailable()}")


@pytest.mark.slow
def test_kernel_runs_the_ordered_attention_in_order(int4_export):
    """With dtrt's ONNX Runtime kernel in place of the function body (dtrt.runtime.backends.ort_ops): the same
    outputs as the body up to fp32 rounding, in use (not bit-identical to it), the same bits whatever the threads
    that share a call's tasks, and tree rows = plain decoding."""
    _kernel()
    from dtrt.runtime.backends.onnxruntime import cpu_session

    rng = np.random.default_rng(0)
    t = int4_export.manifest["target"]
    n, past = 5, 40
    kv = rng.standard_normal((t["num_layers"], t["num_kv_heads"], past + n, t["head_dim"])).astype(np.float32)
    mask = np.tril(np.ones((n, n), bool))
    mask[3, 2] = False  # a tree: row 3 sees 0, 1 and itself
    feeds = {"ids": rng.integers(0, t["vocab_size"], n), "positions": np.arange(past, past + n), "mask": mask}
    feeds |= {"past_k": kv, "past_v": kv.copy(), "past_positions": np.arange(past)}
    kernel, body = (
        cpu_session(int4_export.stage("target"), threads=1, accuracy=0, kernels=k).run(["logits"], feeds)[0]
        for k in (True, False)
    )
    diff = np.abs(kernel - body).max()
    assert 0 < diff <= 5e-4 * np.abs(body).max(), diff
    for threads in (2, 3):  # tasks of a KV head's rows (all of them at N=1, tiles of 6 past that)
        for m in (1, n):
            fed = feeds | {"ids": feeds["ids"][:m], "positions": feeds["positions"][:m], "mask": mask[:m, :m]}
            fed |= {"past_k": kv[:, :, : past + m], "past_v": kv[:, :, : past + m].copy()}
            one, many = (
                cpu_session(int4_export.stage("target"), threads=t, accuracy=0).run(["logits"], fed)[0]
                for t in (1, threads)
            )
            assert np.array_equal(one, many), (threads, m)
    assert all(np.array_equal(want, got) for _, _, want, got in order_check(int4_export))


@pytest.mark.slow
def test_kernel_reports_an_input_it_does_not_serve(int4_export):
    """The kernel's errors come back as ONNX Runtime's, with its message (a C API status, not a crash)."""
    _kernel()
    from dtrt.runtime.backends.onnxruntime import cpu_session

    t = int4_export.manifest["target"]
    n, past = 2, 8
    kv = np.zeros((t["num_layers"], t["num_kv_heads"], past + n, t["head_dim"]), np.float32)
    mask = np.tril(np.ones((n, n), bool))
    feeds = {"ids": np.arange(n), "positions": np.arange(past, past + n), "mask": mask}
    feeds |= {"past_k": kv, "past_v": kv.copy(), "past_positions": np.arange(past)}
    session = cpu_session(int4_export.stage("target"), threads=1, accuracy=0, kernels=True)
    session.run(["logits"], feeds)
    with pytest.raises(Exception, match="outside the caches"):
        session.run(["logits"], feeds | {"past_positions": np.arange(past + n + 1)})


@pytest.mark.slow
def test_kernel_serves_only_what_it_computes(int4_export, tiny_export, monkeypatch, tmp_path):
    from dtrt.runtime.backends import ort_ops

    assert ort_ops.wants_kernel(int4_export.stage("target"))
    # an earlier layout's layers read a slice of the K cache, not the cache: their function body runs
    model = onnx.load(str(int4_export.stage("target")), load_external_data=False)
    next(n for n in model.graph.node if n.op_type == "TreeAttentionPlanned").input[1] = "k_past_slice"
    onnx.save_model(model, str(tmp_path / "earlier.onnx"))
    assert not ort_ops.wants_kernel(tmp_path / "earlier.onnx")
    assert not ort_ops.wants_kernel(tiny_export.stage("target"))  # no ordered attention: an unquantized target
    assert not ort_ops.wants_kernel(int4_export.stage("domino.block"))
    monkeypatch.setenv("DTRT_ORT_OPS", "0")
    assert ort_ops.status() == "turned off (DTRT_ORT_OPS=0)"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (the emulated AVX2 kernel path)")
def test_quality_measures_a_second_kernel_path(tiny_export, int8_export, monkeypatch, capsys):
    """`--kernel-path avx2` runs the configurations in a child process on ONNX Runtime's AVX2 kernels (under QEMU's
    Haswell model): torch there detects AVX2, not this machine's ISA, and the fp32 export still agrees with its own
    native run while the reference stays native."""
    paths = [str(e.path) for e in (tiny_export, int8_export)]
    code, out, err = run_cli(
        monkeypatch, capsys, "quality", *(a for p in paths for a in ("--export", p)), "--datasets", "mt-bench",
        "--texts", "1", "--max-tokens", "48", "--prompts", "0", "--threads", "1", "--kernel-path", "native,avx2",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads(out)["rows"]
    emulated = [r for r in rows if r["kernel_path"] == "avx2 (emulated)"]
    assert len(rows) == 4 and len(emulated) == 2 and all(r["isa"] == "AVX2" for r in emulated)
    assert emulated[0]["agreement"] >= 0.97 and abs(emulated[0]["nll_delta"]) < 1e-3  # fp32: rounding order only
    code, out, err = run_cli(monkeypatch, capsys, "quality", "--export", paths[0], "--kernel-path", "avx512")
    assert code == 2 and err.count("\n") == 1 and "--kernel-path 'avx512': use some of native, avx2" in err

"""`dtrt export --gguf FILE` and `--quant gguf|gguf-a8`: a target computed from its GGUF file's own blocks. A qwen3
GGUF written from the tiny target (Q8_0, Q4_0 and Q4_1 tensors, an F32 one), converted with the real converter: the
checkpoint's blocks are the file's; the exported products hold them bit for bit; every method gives the export's AR
tokens with drafts and lookup nodes accepted, on both configurations; parity passes; the refusals are one line."""

import json

import numpy as np
import onnx
import pytest
import torch
from helpers import generate_all, run_cli, small_disk, spec
from test_ort_backend import ort_pipeline

gguf = pytest.importorskip("gguf")

from dtrt.artifacts.export import load_export  # noqa: E402
from dtrt.exporter.export_config import ExportConfig  # noqa: E402
from dtrt.exporter.reference import reference_stages  # noqa: E402
from dtrt.exporter.write import export_pair  # noqa: E402
from dtrt.models.blocks import PackedBlocks, dequantize, unpack_blocks  # noqa: E402
from dtrt.models.checkpoint import load_target  # noqa: E402
from dtrt.models.gguf_blocks import checkpoint_blocks  # noqa: E402
from dtrt.models.pair import Pair  # noqa: E402
from dtrt.models.target import KVCache  # noqa: E402
from dtrt.parity import run_parity  # noqa: E402
from dtrt.zoo.gguf import LAYER_TENSORS, TOP_TENSORS, converted  # noqa: E402

Q = gguf.GGMLQuantizationType
# the file's type per tensor role: several formats in one file, one linear left F32 (it stays an fp32 product)
KINDS = {
    "attn_q": "Q8_0",
    "attn_k": "Q8_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_0",
    "token_embd": "Q8_0",
}
F32_LINEAR = "blk.3.ffn_down.weight"


# where each K-quant keeps its fp16 numbers (d, dmin): set to small finite values in hand-built blocks
K_FP16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Blocks of a K-quant the `gguf` package cannot quantize to: random codes, scales and mins, small fp16 d/dmin."""
    per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in K_FP16_AT[kind]:
        raw[:, at : at + 2] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // per * size)


def write_qwen3_gguf(checkpoint, path, kinds=None, k_quants=None):
    """The checkpoint's target as a qwen3 GGUF file, quantized with the `gguf` package's own quantizers (`kinds`:
    the type per tensor role, KINDS by default; `k_quants`: GGUF tensor name -> a K-quant of random blocks)."""
    kinds = KINDS if kinds is None else kinds
    k_quants = k_quants or {}
    rng = np.random.default_rng(0)
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    state = load_file(str(checkpoint / "model.safetensors"))
    gguf_name = {f"{v}": k for k, v in TOP_TENSORS.items()}
    w = gguf.GGUFWriter(str(path), arch="qwen3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    unused = [f"<unused{i}>" for i in range(len(vocab), cfg["vocab_size"])]  # the embedding's rows past the tokenizer
    w.add_token_list([t for t, _ in vocab] + unused)
    w.add_token_types([3 if i == cfg["eos_token_id"] else 1 for _, i in vocab] + [5] * len(unused))
    w.add_token_merges([])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_bos_token_id(cfg["bos_token_id"])
    for name, t in state.items():
        if name == "lm_head.weight":
            continue  # tied
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            layer, _, rest = base.removeprefix("model.layers.").partition(".")
            role = next(k for k, v in LAYER_TENSORS.items() if v == rest)
            gname = f"blk.{layer}.{role}.{suffix}"
        else:
            role = gguf_name[base]
            gname = f"{role}.{suffix}"
        data = t.float().numpy()
        kind = kinds.get(role) if data.ndim == 2 and gname != F32_LINEAR else None
        if gname in k_quants:
            w.add_tensor(gname, k_blocks(k_quants[gname], *data.shape, rng), raw_dtype=Q[k_quants[gname]])
        elif kind is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, gguf.quantize(data, Q[kind]), raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory):
    return write_qwen3_gguf(tiny.target, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")


@pytest.fixture(scope="module")
def exports(tiny, gguf_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-exports")
    pair = Pair(converted(gguf_file), tiny.domino, tiny.domino)
    return {
        q: export_pair(pair, root / q, ExportConfig(max_context=512, drafters=("domino",), quant=q), gguf=gguf_file)
        for q in ("gguf", "gguf-a8")
    }


def test_the_converted_checkpoint_holds_the_files_blocks(gguf_file):
    ckpt = converted(gguf_file)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"]
    blocks = checkpoint_blocks(ckpt)
    reader = gguf.GGUFReader(str(gguf_file))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert blocks["model.layers.0.self_attn.o_proj.weight"].kind == "Q4_1"
    assert "model.layers.3.mlp.down_proj.weight" not in blocks and kinds[F32_LINEAR] == "F32"
    target = load_target(ckpt, torch.float32)
    params = dict(target.named_parameters())
    for name, w in blocks.items():  # the checkpoint is its blocks dequantized, and those are gguf's, bit for bit
        assert torch.equal(dequantize(w), params[name].detach()), name
    for t in reader.tensors:
        if t.tensor_type.name in ("Q8_0", "Q4_0", "Q4_1"):
            want = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
            name = next(n for n in blocks if _gguf_name(n) == t.name)
            assert torch.equal(dequantize(blocks[name]), want), t.name  # qwen3: rows as the file's


def _gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, rest = base.removeprefix("model.layers.").partition(".")
        role = next(k for k, v in LAYER_TENSORS.items() if v == rest)
        return f"blk.{layer}.{role}.{suffix}"
    return next(f"{k}.{suffix}" for k, v in TOP_TENSORS.items() if v == base)


def _products(exp):
    """(node, its blocks as a BlockWeight) of every BlockMatMul[Min] of the export's target."""
    model = onnx.load(str(exp.stage("target")))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type.startswith("BlockMatMul"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            packed = PackedBlocks(
                q=inits[n.input[1]],
                scale=inits[n.input[2]],
                min=inits[n.input[3]] if len(n.input) > 3 else None,
                op=n.op_type,
                **attrs,
            )
            out.append((n, unpack_blocks(packed)))
    return out


def test_exported_products_hold_the_files_blocks_bit_for_bit(exports, gguf_file):
    exp = exports["gguf"]
    assert exp.manifest["quant"]["format"] == "gguf" and exp.quant_name == "gguf"
    assert exp.manifest["ordered_attention"]["min_rows"] == 1
    blocks = checkpoint_blocks(converted(gguf_file))
    products = _products(exp)
    # q/k/v merged, gate/up merged: per layer 4 products, the last layer's down_proj (F32) not one; and the lm_head
    layers = exp.manifest["target"]["num_layers"]
    assert len(products) == 4 * layers - 1 + 1
    have = torch.cat([dequantize(w).reshape(-1) for _, w in products])
    names = [n for n in blocks]
    want = torch.cat([dequantize(blocks[n]).reshape(-1) for n in names])
    assert have.numel() == want.numel()
    # each product's weights, compared per source tensor by value sets (merged products concatenate rows)
    rows = {tuple(r.tolist()) for _, w in products for r in dequantize(w)}
    for n in names:
        assert all(tuple(r.tolist()) in rows for r in dequantize(blocks[n])), n
    # Q8_0 a code a byte, Q4_0 two, Q4_1 two with its mins
    assert {(n.op_type, w.kind) for n, w in products} == {
        ("BlockMatMul", "packed8"),
        ("BlockMatMul", "packed4"),
        ("BlockMatMulMin", "packed4"),
    }


def test_gguf_a8_runs_matmulnbits_with_the_min_term(exports):
    exp = exports["gguf-a8"]
    assert exp.manifest["ordered_attention"]["min_rows"] == 2
    graph = onnx.load(str(exp.stage("target")), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(n.domain == "com.microsoft" for n in nbits)
    levels = {onnx.helper.get_attribute_value(a) for n in nbits for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}
    assert sum(n.name.endswith(".withmin") for n in graph.node) == exp.manifest["target"]["num_layers"]  # o_proj Q4_1


@pytest.mark.parametrize("config", ["gguf", "gguf-a8"])
@pytest.mark.parametrize(
    "draft",
    [spec("dominotree"), spec("dominotree", lookup=True), spec("ddtree"), spec("lookup")],
    ids=["dominotree", "dominotree+lookup", "ddtree", "lookup"],
)
def test_every_method_gives_the_exports_ar_tokens_with_drafts_accepted(exports, config, draft):
    exp = exports[config]
    ar = [g.tokens for g in generate_all(ort_pipeline(exp, spec("ar")), max_new=48)]
    gens = generate_all(ort_pipeline(exp, draft), max_new=48)
    assert [g.tokens for g in gens] == ar
    rounds = [r for g in gens for r in g.rounds]
    assert sum(r.accepted for r in rounds) / len(rounds) > (1.2 if draft.method == "lookup" else 1.5)
    if draft.lookup or draft.method == "lookup":
        assert sum(r.lookup for r in rounds) > 0  # lookup's nodes accepted too


@pytest.mark.parametrize("config", ["gguf", "gguf-a8"])
def test_parity_passes(exports, config):
    exp = exports[config]
    report = run_parity(exp, 0, stages={"target": reference_stages(exp)["target"]})
    assert report.ok, report.table()
    assert all(r.max_abs == 0.0 for r in report.rows if "tree = plain decoding" in r.case)


@pytest.mark.slow
def test_a_second_process_keeps_the_files_blocks_in_the_same_bytes(exports, tiny, gguf_file, tmp_path):
    from test_export_jobs import digests

    pair = Pair(converted(gguf_file), tiny.domino, tiny.domino)
    cfg = ExportConfig(max_context=512, drafters=("domino",), quant="gguf", jobs=2)
    logs = []
    exp = export_pair(pair, tmp_path / "gguf", cfg, gguf=gguf_file, log=logs.append)
    assert digests(exp.path) == digests(exports["gguf"].path)
    assert any("weights kept as blocks" in m for m in logs) and any("second process" in m for m in logs)


def test_the_command_defaults_to_the_files_blocks(tmp_path, monkeypatch, capsys, tiny, gguf_file):
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        monkeypatch, capsys, "export", "--gguf", str(gguf_file), "--out", str(out), "--max-context", "256"
    )
    assert code == 0, err
    exp = load_export(out)
    assert exp.quant_name == "gguf" and exp.manifest["source"]["gguf"] == str(gguf_file.resolve())
    assert not exp.drafters  # no drafter: prompt lookup still runs
    ar = [g.tokens for g in generate_all(ort_pipeline(exp, spec("ar")), max_new=24)]
    assert [g.tokens for g in generate_all(ort_pipeline(exp, spec("lookup")), max_new=24)] == ar
    assert f"--gguf {gguf_file.resolve()}" in exp.fix_hint()


def test_refusals_are_one_line(tmp_path, monkeypatch, capsys, gguf_file, tiny):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), arch="gemma2")  # an architecture dtrt does not read
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tq = write_qwen3_gguf(tiny.target, tmp_path / "tq.gguf", {**KINDS, "ffn_down": "TQ2_0"})  # a type dtrt cannot keep
    for args, want in [
        (["--gguf", str(tmp_path / "missing.gguf")], "no such file"),
        (["--gguf", str(bad)], "not a GGUF file"),
        (["--gguf", str(gguf_file), "--model", "tiny"], "drop --model"),
        (["--model", "tiny", "--quant", "gguf"], "gguf_blocks.safetensors"),
        (["--gguf", str(tmp_path / "q2.gguf")], "architecture 'gemma2' is not supported"),
        (["--gguf", str(tq)], "'model.layers.0.mlp.down_proj.weight' is TQ2_0, which dtrt cannot keep as blocks"),
    ]:
        code, _, err = run_cli(monkeypatch, capsys, "export", *args, "--out", str(tmp_path / "out"))
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert code != 0 and len(errors) == 1 and want in errors[0] and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


def test_a_conversion_by_an_older_dtrt_is_made_again(tmp_path, monkeypatch, tiny):
    """A file converted by a dtrt that could not keep its Q5_0 tensors as blocks (their types recorded, no rows) is
    converted again when exported, and its blocks, read as they are, are refused in one line."""
    from safetensors.torch import load_file, save_file

    from dtrt.errors import DtrtError
    from dtrt.models.gguf_blocks import BLOCKS_FILE, unkept

    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "cache"))
    path = write_qwen3_gguf(tiny.target, tmp_path / "q5.gguf", FALLBACKS)
    ckpt = converted(path)
    assert unkept(ckpt) == [] and len(checkpoint_blocks(ckpt)) > 0
    blocks = ckpt / BLOCKS_FILE
    from safetensors import safe_open

    with safe_open(str(blocks), "pt") as f:
        meta = f.metadata()
    kinds = json.loads(meta["kinds"])
    rows = {n: t for n, t in load_file(str(blocks)).items() if kinds[n] not in ("Q5_0", "Q5_1")}
    save_file(rows, str(blocks), metadata=meta)  # as the older dtrt wrote it
    stale = unkept(ckpt)
    assert stale and all(kinds[n] in ("Q5_0", "Q5_1") for n in stale)
    with pytest.raises(DtrtError, match="an older dtrt could not keep them") as e:
        checkpoint_blocks(ckpt)
    assert "\n" not in str(e.value)
    lines = []
    assert converted(path, log=lines.append) == ckpt
    assert unkept(ckpt) == [] and any("again" in line for line in lines)


def test_a_conversion_that_cannot_fit_is_refused_before_it_writes(tmp_path, monkeypatch, capsys, gguf_file):
    small_disk(monkeypatch, 1000)
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "cache"))  # not converted yet
    code, _, err = run_cli(monkeypatch, capsys, "export", "--gguf", str(gguf_file), "--out", str(tmp_path / "out"))
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: converting {gguf_file.name} writes about 0.0") and "DTRT_CACHE" in err
    assert not (tmp_path / "out").exists() and not list((tmp_path / "cache" / "gguf").iterdir())


def test_a_qwen2_file_keeps_its_biases_and_answers_as_transformers(tmp_path, monkeypatch, capsys):
    """Qwen2: q/k/v with biases, o without, no per-head norms, RoPE on halves (no llama row order): the converted
    checkpoint's logits are transformers' Qwen2ForCausalLM's on the same files, and its gguf export runs."""
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    hidden, inter, heads, kv, hd, vocab, layers = 64, 128, 4, 2, 16, 96, 2
    path = tmp_path / "qwen2.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, inter), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                   (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-6)):  # fmt: skip
        add(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(0)

    def weight(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", gguf.quantize(weight(vocab, hidden, scale=0.5), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", 1 + weight(hidden))
    for i in range(layers):
        shapes = {
            "attn_q": (heads * hd, hidden),
            "attn_k": (kv * hd, hidden),
            "attn_v": (kv * hd, hidden),
            "attn_output": (hidden, heads * hd),
            "ffn_gate": (inter, hidden),
            "ffn_up": (inter, hidden),
            "ffn_down": (hidden, inter),
        }
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", gguf.quantize(weight(*shape), Q.Q4_1), raw_dtype=Q.Q4_1)
        for name, n in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            w.add_tensor(f"blk.{i}.{name}.bias", weight(n, scale=0.5))
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + weight(hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + weight(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = converted(path)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["attention_bias"]
    ours = load_target(ckpt, torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    ids = torch.tensor([[3, 17, 42, 5, 9, 60, 11, 2]])
    n = ids.shape[1]
    with torch.no_grad():
        want = theirs(ids).logits[0]
        have, _ = ours(ids[0], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), KVCache(ours.cfg, n))
    assert (have - want).abs().max() <= 1e-4 * want.abs().max()
    out = tmp_path / "out"
    code, _, err = run_cli(
        monkeypatch, capsys, "export", "--gguf", str(path), "--out", str(out), "--max-context", "128"
    )
    assert code == 0, err
    exp = load_export(out)
    assert exp.quant_name == "gguf"
    from dtrt.runtime.sampling import SamplingConfig

    prompt = [3, 17, 42, 5, 9, 60, 11, 2, 3, 17, 42, 5]
    ar = ort_pipeline(exp, spec("ar")).generate(prompt, 16, SamplingConfig()).tokens
    assert ort_pipeline(exp, spec("lookup")).generate(prompt, 16, SamplingConfig()).tokens == ar


# llama.cpp's K-quant mixes fall back to Q5_0 (for Q4_K), Q5_1 (for Q5_K) and Q8_0 (for Q6_K) on a tensor whose
# input features are no multiple of 256, as these 96-wide ones: a Q4_K_M-like file of a small model
FALLBACKS = KINDS | {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_1", "ffn_gate": "Q5_0", "ffn_up": "Q5_1"}


@pytest.mark.parametrize(
    ("k_quants", "kinds"),
    [
        ({f"blk.{i}.ffn_down.weight": k for i, k in enumerate(("Q4_K", "Q5_K", "Q6_K"))}, None),
        ({f"blk.{i}.ffn_down.weight": k for i, k in enumerate(("Q2_K", "Q3_K", "Q4_K"))}, FALLBACKS),
    ],
    ids=["q4k-q5k-q6k", "q2k-q3k-q5_0-q5_1"],
)
def test_k_quant_products_hold_the_files_blocks_bit_for_bit(tiny, tmp_path, k_quants, kinds):
    """Every K-quant (on the down projections, whose 256 input features fill a super-block) and Q5_0/Q5_1 (the
    K-quant mixes' fallbacks, on the 96-wide products): each export's products dequantize to the file's tensors as
    the `gguf` package dequantizes them, bit for bit, and plain decoding equals prompt lookup's on both
    configurations."""
    from dtrt.runtime.sampling import SamplingConfig

    path = write_qwen3_gguf(tiny.target, tmp_path / "k.gguf", kinds=kinds, k_quants=k_quants)
    ckpt = converted(path)
    reader = gguf.GGUFReader(str(path))
    want = {
        t.name: torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        for t in reader.tensors
        if t.name in k_quants or t.tensor_type.name in ("Q5_0", "Q5_1")
    }
    held = {t.tensor_type.name for t in reader.tensors if t.name in want}
    assert held == set(k_quants.values()) | ({"Q5_0", "Q5_1"} if kinds else set())
    prompt = [40, 41, 3, 60, 70, 3, 40, 41, 3, 60]
    for quant in ("gguf", "gguf-a8"):
        exp = export_pair(Pair(ckpt, None, None), tmp_path / quant, ExportConfig(max_context=128, quant=quant))
        if quant == "gguf":
            rows = {tuple(r.tolist()) for _, w in _products(exp) for r in dequantize(w)}
            for name, w in want.items():
                assert all(tuple(r.tolist()) in rows for r in w), name
        ar = ort_pipeline(exp, spec("ar")).generate(prompt, 16, SamplingConfig()).tokens
        assert ort_pipeline(exp, spec("lookup")).generate(prompt, 16, SamplingConfig()).tokens == ar


def test_the_torch_backend_runs_the_checkpoint_and_refuses_one_without_blocks(tiny, gguf_file):
    """--quant gguf on the torch backend is the converted fp32 checkpoint (the blocks dequantized): DominoTree
    gives its AR tokens with drafts accepted; a checkpoint not converted from a GGUF file is refused in one line."""
    from helpers import pipe_for

    from dtrt.errors import DtrtError

    pair = Pair(converted(gguf_file), tiny.domino, tiny.domino)
    ar = [g.tokens for g in generate_all(pipe_for(pair, spec("ar", quant="gguf")), max_new=24)]
    gens = generate_all(pipe_for(pair, spec("dominotree", quant="gguf")), max_new=24)
    assert [g.tokens for g in gens] == ar
    assert sum(r.accepted for g in gens for r in g.rounds) / sum(len(g.rounds) for g in gens) > 1.5
    with pytest.raises(DtrtError, match="has no gguf_blocks.safetensors"):
        pipe_for(tiny, spec("ar", quant="gguf"))

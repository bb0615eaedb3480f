"""dtrt::BlockMatMul and dtrt::BlockMatMulMin: a GGUF file's blocks packed as the ops take them
(dtrt.models.blocks.pack_blocks) and back bit for bit; the function bodies on a plain ONNX Runtime session against
the PyTorch reference (dtrt.models.blocks.block_matmul); dtrt's kernel (dtrt.runtime.backends.ort_ops) against the
reference, its rows independent of the row count and of the thread count bit for bit, its bits those of its
documented order (so a session that ran the function body instead would fail), on each of its paths (AVX2, and
AVX-512F where the CPU has it: DTRT_BLOCK_ISA picks), its errors one line; and which graphs load the library
(wants_kernel)."""

import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from test_gguf_blocks import FP16_AT  # noqa: E402

from dtrt.artifacts.kernel_path import emulated_command  # noqa: E402
from dtrt.models.blocks import (  # noqa: E402
    FOUR_BITS,
    BlockWeight,
    PackedBlocks,
    block_matmul,
    dequantize,
    pack_blocks,
    scaled_codes,
    unpack_blocks,
)
from dtrt.models.gguf_blocks import LAYOUT, expand  # noqa: E402
from dtrt.ops.base import onnx_functions  # noqa: E402
from dtrt.plugins import DOMAIN, VERSION  # noqa: E402
from dtrt.runtime.backends import ort_ops  # noqa: E402

Q = gguf.GGMLQuantizationType
FORMATS = tuple(LAYOUT)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
INVARIANT_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64)  # each kernel path and each short last tile
ISAS = ("avx2", "avx512f")  # the kernel's paths (ort_ops.block_isa)


def hand_built(kind: str, n: int, k: int, rng) -> np.ndarray:
    """Random blocks of `kind` for [n, k] weights: random bytes with finite fp16 scales of a moderate size."""
    per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    count = n * k // per
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in FP16_AT[kind]:
        d = (rng.standard_normal(count) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(count, 2)
    return raw.reshape(n, k // per * size)


def weight(kind: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    """An [n, k] weight of `kind` as a GGUF file holds it: the `gguf` package's own quantization where it has one
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), hand-built blocks otherwise (the K-quants)."""
    rng = np.random.default_rng(seed)
    try:
        raw = gguf.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, Q[kind])
    except NotImplementedError:
        raw = hand_built(kind, n, k, rng)
    return expand(name=f"{kind}.weight", kind=kind, data=raw)


def packed(w: BlockWeight) -> PackedBlocks:
    return pack_blocks(w)


def model(p: PackedBlocks) -> bytes:
    """One dtrt::BlockMatMul[Min] node over x [..., K] (any rank) with its blocks as initializers and its function
    attached."""
    arrays = {"q": p.q, "scale": p.scale} | ({} if p.min is None else {"min": p.min})
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    node = helper.make_node(p.op, ["x", *arrays], ["y"], domain=DOMAIN, bits=p.bits, block=p.block, zero=p.zero)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "block_matmul", [x], [y], inits)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, VERSION)]
    m = helper.make_model(graph, opset_imports=opsets, functions=onnx_functions([p.op]))
    m.ir_version = 10
    return m.SerializeToString()


def session(p: PackedBlocks, *, kernel: bool, threads: int = 1, optimized=None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if optimized is not None:
        opts.optimized_model_filepath = str(optimized)
    if kernel:
        opts.register_custom_ops_library(str(ort_ops.library()))
    return ort.InferenceSession(model(p), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def library():
    if ort_ops.library() is None:
        pytest.skip(f"dtrt's ONNX Runtime kernel: {ort_ops.unavailable()}")
    return ort_ops.library()


@pytest.fixture(params=ISAS)
def isa(request, library, monkeypatch):
    """The kernel's path for the sessions the test makes (DTRT_BLOCK_ISA, which the kernel reads when a session
    creates it): each test runs on the AVX2 path and on the AVX-512F one, which it skips where the CPU lacks it."""
    if request.param == "avx512f" and "avx512f" not in ort_ops.cpu_flags():
        pytest.skip("this CPU lacks AVX-512F: the kernel has only its AVX2 path here")
    monkeypatch.setenv("DTRT_BLOCK_ISA", request.param)
    assert ort_ops.block_isa() == request.param
    return request.param


def bound(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """fp32 rounding's scale for the product's two terms: 1e-5 of |x|·|scale∘(q - zero)|ᵀ + |blocksum(x)|·|min|ᵀ."""
    b = x.double().abs() @ scaled_codes(w).double().abs().T
    if w.min is not None:
        b = b + w.blocked(x).sum(-1).double().abs() @ w.min.double().abs().T
    return 1e-5 * b + 1e-30


def assert_close(got: np.ndarray, x: np.ndarray, w: BlockWeight):
    want = block_matmul(x=torch.from_numpy(x), w=w).double()
    err = (torch.from_numpy(got).double() - want).abs()
    assert bool((err <= bound(torch.from_numpy(x), w)).all()), float(err.max())


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


def rows(m: int, k: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


# packing


@pytest.mark.parametrize("kind", FORMATS)
def test_packing_round_trips_bit_for_bit(kind):
    w = weight(kind, 24, 512)
    p = packed(w)
    assert p.q.dtype == np.uint8 and p.scale.dtype == np.float32 and p.block == w.block
    assert p.op == ("BlockMatMul" if w.min is None else "BlockMatMulMin")
    assert (p.min is None) == (w.min is None)
    if kind in FOUR_BITS:
        assert p.bits == 4 and p.q.shape == (24, 256) and p.zero == w.zero
    elif kind == "Q8_0":
        assert p.bits == 8 and p.q.shape == (24, 512) and p.zero == 128
    else:
        assert p.bits == 8 and p.q.shape == (24, 512) and p.zero == w.zero
        assert np.array_equal(p.q, w.q.numpy())  # the codes as they are
    back = unpack_blocks(p)
    assert back.q.dtype == w.q.dtype and torch.equal(back.q, w.q) and back.zero == w.zero
    assert torch.equal(dequantize(back).view(torch.int32), dequantize(w).view(torch.int32))
    # a PackedBlocks read back from a graph (no format name) dequantizes the same
    plain = unpack_blocks(
        PackedBlocks(q=p.q, scale=p.scale, min=p.min, bits=p.bits, block=p.block, zero=p.zero, op=p.op)
    )
    assert torch.equal(dequantize(plain).view(torch.int32), dequantize(w).view(torch.int32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_codes_are_ggufs_bytes(kind):
    """Q4_0's and Q4_1's packed codes are the file's own nibble bytes, block after block."""
    rng = np.random.default_rng(3)
    raw = gguf.quantize(rng.standard_normal((8, 256)).astype(np.float32), Q[kind])
    size, _ = LAYOUT[kind]
    blocks = raw.reshape(8, -1, size)
    nibbles = blocks[:, :, size - 16 :].reshape(8, -1)
    assert np.array_equal(packed(expand(name="w", kind=kind, data=raw)).q, nibbles)


def test_packing_refuses_what_it_cannot_hold():
    w = weight("Q4_1", 8, 256)
    with pytest.raises(ValueError, match="2-D"):
        pack_blocks(BlockWeight("Q4_1", w.q.reshape(2, 4, 256), w.scale.reshape(2, 4, 8), None, 0, 32))
    with pytest.raises(ValueError, match="IQ4_NL"):
        pack_blocks(BlockWeight("IQ4_NL", w.q, w.scale, None, 0, 32))
    with pytest.raises(ValueError, match="above 15"):
        pack_blocks(BlockWeight("Q4_1", w.q + 16, w.scale, w.min, 0, 32))


# the function bodies (no kernel)


@pytest.mark.parametrize("kind", FORMATS)
def test_function_body_matches_the_reference(kind):
    w = weight(kind, 40, 512)
    s = session(packed(w), kernel=False)
    x = rows(7, 512)
    assert_close(s.run(None, {"x": x})[0], x, w)
    # any leading dims: [1, rows, K]
    y = s.run(None, {"x": x[None]})[0]
    assert y.shape == (1, 7, 40)
    assert_close(y[0], x, w)


# the kernel


@pytest.mark.parametrize("kind", FORMATS)
def test_kernel_matches_the_reference(isa, kind):
    w = weight(kind, 56, 256)
    s = session(packed(w), kernel=True)
    x = rows(64, 256)
    for m in range(1, 65):
        assert_close(s.run(None, {"x": x[:m]})[0], x[:m], w)
    y = s.run(None, {"x": x[None, :5]})[0]  # [1, rows, K]
    assert y.shape == (1, 5, 56) and same_bits(y[0], s.run(None, {"x": x[:5]})[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q5_1", "Q3_K", "Q6_K", "Q8_0"])
def test_kernel_rows_do_not_depend_on_the_row_count(isa, kind, threads):
    """Row i of an M-row call equals the 1-row call on that row bit for bit, for every M (a prefill's 300 rows
    included), at 1 and 2 intra-op threads (N = 100: panels on both threads, one of them short)."""
    w = weight(kind, 100, 512, seed=2)
    s = session(packed(w), kernel=True, threads=threads)
    x = rows(300, 512, seed=5)
    alone = np.concatenate([s.run(None, {"x": x[i : i + 1]})[0] for i in range(64)])
    for m in INVARIANT_ROWS:
        assert same_bits(s.run(None, {"x": x[:m]})[0], alone[:m]), m
    prefill = s.run(None, {"x": x})[0]
    assert same_bits(prefill[:64], alone)
    for i in (64, 150, 299):
        assert same_bits(prefill[i : i + 1], s.run(None, {"x": x[i : i + 1]})[0]), i


def test_kernel_on_an_lm_head_shape(isa):
    """A Q8_0 lm_head whose N (1000) is no multiple of the kernel's panels or tiles: close to the reference, rows
    independent of the row count, at 1 and 2 threads alike."""
    w = weight("Q8_0", 1000, 576, seed=4)
    one, two = (session(packed(w), kernel=True, threads=t) for t in (1, 2))
    x = rows(16, 576, seed=6)
    alone = np.concatenate([one.run(None, {"x": x[i : i + 1]})[0] for i in range(16)])
    assert_close(alone, x, w)
    for m in (1, 2, 3, 4, 5, 9, 16):
        assert same_bits(one.run(None, {"x": x[:m]})[0], alone[:m]), m
        assert same_bits(two.run(None, {"x": x[:m]})[0], alone[:m]), m


def tree8(v: np.ndarray) -> np.ndarray:
    """[..., 8] fp32 -> ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))."""
    return ((v[..., 0] + v[..., 1]) + (v[..., 2] + v[..., 3])) + ((v[..., 4] + v[..., 5]) + (v[..., 6] + v[..., 7]))


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c rounded once: the product is exact in x87's 64-bit mantissa, and the sum is rounded there
    first (a second rounding that differs from one only at a 2^-40 chance)."""
    wide = np.longdouble
    return (a.astype(wide) * b.astype(wide) + c.astype(wide)).astype(np.float32)


def kernel_order(x: np.ndarray, p: PackedBlocks, lanes: int) -> np.ndarray:
    """The kernel's documented order on its path of `lanes` lanes (8: AVX2, 16: AVX-512F), step by step: w = scale
    * (q - zero) rounded once; per output one accumulator of `lanes` lanes taking fma(w, x) chunk after chunk in k
    order; BlockMatMulMin's blocks' sums of x (chunks of 8 added lane-wise, then tree8) times min into lane
    b % lanes in block order; 16 lanes: lanes l and l + 8 added; then tree8."""
    w = scaled_codes(unpack_blocks(p)).numpy()  # [N, K]
    m, k = x.shape
    n = w.shape[0]
    acc = np.zeros((m, n, lanes), np.float32)
    for i in range(0, k, lanes):
        acc = fma(x[:, None, i : i + lanes], w[None, :, i : i + lanes], acc)
    if p.min is not None:
        nb = k // p.block
        chunks = x.reshape(m, nb, p.block // 8, 8)
        s = chunks[:, :, 0]
        for c in range(1, p.block // 8):
            s = s + chunks[:, :, c]
        pad = -nb % lanes
        bsum = np.concatenate([tree8(s), np.zeros((m, pad), np.float32)], axis=1)  # [M, nb + pad]
        mins = np.concatenate([p.min, np.zeros((n, pad), np.float32)], axis=1)
        for b in range(0, nb + pad, lanes):
            acc = fma(bsum[:, None, b : b + lanes], mins[None, :, b : b + lanes], acc)
    if lanes == 16:
        acc = acc[..., :8] + acc[..., 8:]
    return tree8(acc)


def order_case(kind: str) -> PackedBlocks:
    """Blocks for the order tests: a format's, or 4-bit codes in blocks of 16 (no format's layout, which the ops
    take too) with mins and a zero."""
    if kind != "4 bits, blocks of 16":
        return packed(weight(kind, 30, 256 if kind.endswith("_K") else 320, seed=7))
    rng = np.random.default_rng(7)
    scale = (rng.random((30, 16)) * 0.01).astype(np.float32)
    mins = (rng.random((30, 16)) * -0.05).astype(np.float32)
    q = rng.integers(0, 256, (30, 128), dtype=np.uint8)
    return PackedBlocks(q=q, scale=scale, min=mins, bits=4, block=16, zero=8, op="BlockMatMulMin")


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q2_K", "Q3_K", "Q6_K", "Q8_0", "4 bits, blocks of 16"])
def test_the_session_runs_the_kernel_in_its_order(isa, kind, tmp_path):
    """A session with the library runs the kernel, not the function body, on the path DTRT_BLOCK_ISA picks: the
    optimized graph keeps the dtrt node (the body's would be inlined into standard ops), and its outputs are that
    path's documented order's bits at every row count (each of the path's loops), which neither the other path's
    order nor the body's MatMul gives."""
    p = order_case(kind)
    k = p.scale.shape[1] * p.block
    x = rows(17, k, seed=8)
    s = session(p, kernel=True, optimized=tmp_path / "kernel.onnx")
    lanes, other = (16, 8) if isa == "avx512f" else (8, 16)
    want = kernel_order(x, p, lanes)
    assert not same_bits(want, kernel_order(x, p, other))
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
        assert same_bits(s.run(None, {"x": x[:m]})[0], want[:m]), m
    nodes = onnx.load(str(tmp_path / "kernel.onnx")).graph.node
    assert [(n.domain, n.op_type) for n in nodes] == [(DOMAIN, p.op)]
    body = session(p, kernel=False, optimized=tmp_path / "body.onnx")
    assert DOMAIN not in {n.domain for n in onnx.load(str(tmp_path / "body.onnx")).graph.node}
    assert not same_bits(body.run(None, {"x": x})[0], want)


RUN_EMULATED = """
import sys
import numpy as np
import onnxruntime as ort
library, model, x, out = sys.argv[1:]
opts = ort.SessionOptions()
opts.intra_op_num_threads = 1
opts.register_custom_ops_library(library)
s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
x = np.load(x)
np.savez(out, *[s.run(None, {"x": x[:m]})[0] for m in (1, 5, 9)])
"""


def test_a_cpu_without_avx512_runs_the_avx2_path(library, tmp_path):
    """On a CPU with AVX2 and FMA but no AVX-512 (QEMU's Haswell model runs the process) the library loads and the
    kernel takes its AVX2 path by itself: its outputs are the 8-lane order's bits."""
    try:
        command, env = emulated_command("avx2", ["-c", RUN_EMULATED])
    except ValueError as e:
        pytest.skip(str(e))
    env.pop("DTRT_BLOCK_ISA", None)
    p = packed(weight("Q4_1", 30, 320, seed=9))
    x = rows(9, 320, seed=10)
    (tmp_path / "m.onnx").write_bytes(model(p))
    np.save(tmp_path / "x.npy", x)
    args = [str(library), str(tmp_path / "m.onnx"), str(tmp_path / "x.npy"), str(tmp_path / "y.npz")]
    run = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(tmp_path / "y.npz")
    want = kernel_order(x, p, 8)
    for i, m in enumerate((1, 5, 9)):
        assert same_bits(got[f"arr_{i}"], want[:m]), m


def test_block_isa_follows_the_cpu_and_the_switch(monkeypatch):
    """The path a session's kernel takes: AVX-512F where the CPU has it, unless DTRT_BLOCK_ISA=avx2."""
    monkeypatch.delenv("DTRT_BLOCK_ISA", raising=False)
    monkeypatch.setattr(ort_ops, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert ort_ops.block_isa() == "avx512f"
    monkeypatch.setenv("DTRT_BLOCK_ISA", "avx2")
    assert ort_ops.block_isa() == "avx2"
    monkeypatch.setattr(ort_ops, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv("DTRT_BLOCK_ISA")
    assert ort_ops.block_isa() == "avx2"


def one_line(e, prefix: str) -> str:
    """The kernel's message within ONNX Runtime's: from its op name on, one line."""
    msg = str(e.value)
    tail = msg[msg.index(prefix) :].strip()
    assert "\n" not in tail, msg
    return tail


def test_kernel_reports_what_it_cannot_compute_in_one_line(library):
    p = packed(weight("Q4_1", 16, 256))
    s = session(p, kernel=True)
    with pytest.raises(Exception) as e:
        s.run(None, {"x": rows(2, 224)})
    assert one_line(e, "BlockMatMulMin:").startswith(
        "BlockMatMulMin: x [..., 224] and bits 4, block 32 need q [N, 112]"
    )
    with pytest.raises(Exception) as e:
        s.run(None, {"x": rows(2, 100)})
    assert one_line(e, "BlockMatMulMin:") == "BlockMatMulMin: K = 100 is not a multiple of block 32"
    bad = PackedBlocks(q=p.q, scale=p.scale, min=p.min, bits=3, block=p.block, zero=p.zero, op=p.op)
    with pytest.raises(Exception) as e:
        session(bad, kernel=True).run(None, {"x": rows(1, 256)})
    assert one_line(e, "BlockMatMulMin:").startswith("BlockMatMulMin: bits 3, block 32, zero 0 (it takes bits 4 or 8")
    # the session still serves good calls after a refused one
    assert s.run(None, {"x": rows(1, 256)})[0].shape == (1, 16)


def test_kernel_takes_empty_calls(isa):
    p = packed(weight("Q8_0", 16, 256))
    y = session(p, kernel=True).run(None, {"x": np.zeros((0, 256), np.float32)})[0]
    assert y.shape == (0, 16)
    # K = 0: every output an empty sum, +0
    q, scale = np.zeros((16, 0), np.uint8), np.zeros((16, 0), np.float32)
    empty = PackedBlocks(q=q, scale=scale, min=scale, bits=4, block=32, zero=8, op="BlockMatMulMin")
    s = session(empty, kernel=True)
    for m in (1, 9, 17):
        assert same_bits(s.run(None, {"x": np.zeros((m, 0), np.float32)})[0], np.zeros((m, 16), np.float32)), m


# which graphs load the library


def stage(path, nodes, inputs=()) -> str:
    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    graph = helper.make_graph(nodes, "stage", x, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save_model(helper.make_model(graph), str(path))
    return path


def test_graphs_with_block_products_want_the_library(tmp_path):
    block = helper.make_node("BlockMatMul", ["x", "q", "s"], ["y"], domain=DOMAIN, bits=4, block=32, zero=8)
    assert ort_ops.wants_kernel(stage(tmp_path / "blocks.onnx", [block]))
    assert not ort_ops.wants_kernel(stage(tmp_path / "none.onnx", [helper.make_node("Relu", ["x"], ["y"])]))
    # another domain's BlockMatMul is not ours
    other = helper.make_node("BlockMatMul", ["x", "q", "s"], ["y"], domain="other")
    assert not ort_ops.wants_kernel(stage(tmp_path / "other.onnx", [other]))

    def attention(hd):
        ins = ["q", "past_k", "k_new", "past_v", *(f"i{j}" for j in range(19))]
        node = helper.make_node("TreeAttentionPlanned", ins, ["a"], domain=DOMAIN)
        return [node], [("past_v", [2, 2, 16, hd])]

    served, past = attention(64)
    assert ort_ops.wants_kernel(stage(tmp_path / "both.onnx", [*served, block], past))
    # ordered attention the kernel cannot serve: loading the library would take those nodes over, so no library
    unserved, past = attention(100)
    assert not ort_ops.wants_kernel(stage(tmp_path / "unserved.onnx", [*unserved, block], past))

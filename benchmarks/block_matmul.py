"""Milliseconds per call of dtrt's BlockMatMul kernel (dtrt.runtime.backends.ort_ops: a GGUF file's 4- and 8-bit
blocks, fp32 activations, every row in one fixed order) beside ONNX Runtime's fp32 MatMul on the dequantized
weights and its MatMulNBits (com.microsoft: bits 4, blocks of 32, uint8 zero points) at accuracy levels 4 (int8
activations) and 1 (fp32), at SmolLM2-135M's and Qwen3-4B's linear shapes, M = 1, 2, 4, 8, 16 rows (a verify's
widths), random weights. Each session holds one node; every repeat times one call of each in turn, and the table
gives the medians (a call includes ONNX Runtime's per-run overhead, the `overhead` line: an Identity node). The
kernel runs on this machine's path (AVX-512F where the CPU has it, else AVX2); `--isa` picks it, and a second path
adds a column (`--isa avx512f,avx2`: the AVX2 path beside the AVX-512F one, in the same repeats). `--formats` times
every shape in other GGUF formats instead of its own (a shape whose K no format's block divides is left out).

    python benchmarks/block_matmul.py                      # one intra-op thread
    python benchmarks/block_matmul.py --threads 2 --json out.json
    python benchmarks/block_matmul.py --models smollm2-135m --rows 1,8 --isa avx512f,avx2
    python benchmarks/block_matmul.py --models smollm2-135m --rows 1,3 --formats Q4_1,Q5_0,Q5_1,Q8_0
"""

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from dtrt.models.blocks import BlockWeight, dequantize, pack_blocks
from dtrt.models.gguf_blocks import LAYOUT, expand
from dtrt.ops.base import onnx_functions
from dtrt.plugins import DOMAIN, VERSION
from dtrt.runtime.backends import ort_ops

# (model, linear, K, N, GGUF format): SmolLM2-135M's Q4_1 layers and Q8_0 lm_head; Qwen3-4B's Q4_K layers (q, k
# and v merged: 4096 + 1024 + 1024)
SHAPES = (
    ("smollm2-135m", "gate/up", 576, 1536, "Q4_1"),
    ("smollm2-135m", "down", 1536, 576, "Q4_1"),
    ("smollm2-135m", "qkv", 576, 960, "Q4_1"),
    ("smollm2-135m", "lm_head", 576, 49152, "Q8_0"),
    ("qwen3-4b", "gate/up", 2560, 9728, "Q4_K"),
    ("qwen3-4b", "down", 9728, 2560, "Q4_K"),
    ("qwen3-4b", "qkv", 2560, 6144, "Q4_K"),
)
METHODS = ("kernel", "fp32", "nbits4", "nbits1")
ISAS = ("avx2", "avx512f")  # the kernel's paths (DTRT_BLOCK_ISA)


def random_weight(kind: str, n: int, k: int, rng) -> BlockWeight:
    """An [n, k] weight of GGUF format `kind`: random blocks of the file's layout (every code), read as a file's,
    then scales and mins of a moderate size."""
    size, per = LAYOUT[kind]
    raw = rng.integers(0, 256, (n, k // per * size), dtype=np.uint8)
    with np.errstate(invalid="ignore"):  # a random fp16 scale may be inf, and inf * 0 NaN: replaced below
        w = expand(name=kind, kind=kind, data=raw)
    scale = torch.from_numpy((rng.random(tuple(w.scale.shape)) * 0.01).astype(np.float32))
    mins = None if w.min is None else torch.from_numpy((rng.random(tuple(w.min.shape)) * -0.05).astype(np.float32))
    return BlockWeight(kind=kind, q=w.q, scale=scale, min=mins, zero=w.zero, block=w.block)


def graph_model(nodes, inits, k: int, opsets, functions=()) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], functions=functions)
    model.ir_version = 10
    return model.SerializeToString()


def kernel_model(w: BlockWeight, k: int) -> bytes:
    p = pack_blocks(w)
    arrays = {"q": p.q, "scale": p.scale} | ({} if p.min is None else {"min": p.min})
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    node = helper.make_node(p.op, ["x", *arrays], ["y"], domain=DOMAIN, bits=p.bits, block=p.block, zero=p.zero)
    return graph_model([node], inits, k, [("", 20), (DOMAIN, VERSION)], onnx_functions([p.op]))


def fp32_model(w: BlockWeight, k: int) -> bytes:
    weight = np.ascontiguousarray(dequantize(w).numpy().T)
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return graph_model([node], [numpy_helper.from_array(weight, "w")], k, [("", 20)])


def nbits_model(n: int, k: int, accuracy: int, rng) -> bytes:
    blocks = k // 32
    b = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
    scales = (rng.random(n * blocks) * 0.01).astype(np.float32)
    zeros = rng.integers(0, 256, n * ((blocks + 1) // 2), dtype=np.uint8)
    inits = [numpy_helper.from_array(a, name) for name, a in (("b", b), ("scales", scales), ("zeros", zeros))]
    node = helper.make_node(
        "MatMulNBits",
        ["x", "b", "scales", "zeros"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=accuracy,
    )
    return graph_model([node], inits, k, [("", 20), ("com.microsoft", 1)])


def kernel_session(model: bytes, threads: int, library, isa: str) -> ort.InferenceSession:
    """A session whose kernel takes path `isa` (DTRT_BLOCK_ISA, read when the session creates the kernel)."""
    before = os.environ.get("DTRT_BLOCK_ISA")
    os.environ["DTRT_BLOCK_ISA"] = isa
    try:
        return session(model, threads, library)
    finally:
        if before is None:
            del os.environ["DTRT_BLOCK_ISA"]
        else:
            os.environ["DTRT_BLOCK_ISA"] = before


def session(model: bytes, threads: int, library=None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def medians(sessions: dict, x: np.ndarray, repeats: int, warmup: int) -> dict[str, float]:
    """ms per call, the median over `repeats` rounds that each time one call of every session in turn."""
    feeds = {"x": x}
    for s in sessions.values():
        for _ in range(warmup):
            s.run(None, feeds)
    times = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every session (default 1)")
    ap.add_argument("--rows", default="1,2,4,8,16", help="the M values, comma-separated")
    ap.add_argument("--models", default="smollm2-135m,qwen3-4b")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--isa",
        default=ort_ops.block_isa(),
        help="the kernel's paths, comma-separated (avx2, avx512f; default: this machine's): the first is the "
        "`kernel` column, each further one a column of its name",
    )
    ap.add_argument(
        "--formats",
        help=f"time every shape in these GGUF formats instead of its own, comma-separated ({', '.join(LAYOUT)})",
    )
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    formats = args.formats.split(",") if args.formats else None
    if formats and (bad := [f for f in formats if f not in LAYOUT]):
        ap.error(f"--formats {','.join(bad)}: the formats are {', '.join(LAYOUT)}")
    rows_m = [int(v) for v in args.rows.split(",")]
    models = args.models.split(",")
    isas = args.isa.split(",")
    if bad := [i for i in isas if i not in ISAS]:
        ap.error(f"--isa {','.join(bad)}: the kernel's paths are {', '.join(ISAS)}")
    if "avx512f" in isas and "avx512f" not in ort_ops.cpu_flags():
        ap.error("--isa avx512f: this CPU lacks AVX-512F")
    methods = (*METHODS, *isas[1:])
    library = ort_ops.library()
    if library is None:
        print(f"dtrt's kernel cannot run here: {ort_ops.unavailable()}; its column is empty")
    rng = np.random.default_rng(args.seed)

    identity = helper.make_node("Identity", ["x"], ["y"])
    overhead = session(graph_model([identity], [], 576, [("", 20)]), args.threads)
    base = medians({"overhead": overhead}, np.zeros((1, 576), np.float32), args.repeats, args.warmup)["overhead"]
    print(
        f"ONNX Runtime {ort.__version__}, {platform.processor() or platform.machine()}, {args.threads} intra-op "
        f"thread(s); ms per call (median of {args.repeats}); overhead (an Identity call): {base:.4f} ms; kernel: the "
        f"{isas[0]} path"
    )
    head = f"{'model':<13} {'linear':<8} {'K->N':<11} {'fmt':<5} {'M':>3} " + " ".join(f"{m:>8}" for m in methods)
    print(head + f" {'fp32/kern':>9} {'nb4/kern':>8}")
    out = []
    cases = [
        (model, linear, k, n, kind)
        for model, linear, k, n, own in SHAPES
        for kind in (formats or [own])
        if model in models and k % LAYOUT[kind][1] == 0
    ]
    for model, linear, k, n, kind in cases:
        w = random_weight(kind, n, k, rng)
        sessions = {
            "fp32": session(fp32_model(w, k), args.threads),
            "nbits4": session(nbits_model(n, k, 4, rng), args.threads),
            "nbits1": session(nbits_model(n, k, 1, rng), args.threads),
        }
        if library is not None:
            kernels = {name: kernel_model(w, k) for name in ("kernel", *isas[1:])}
            paths = {"kernel": isas[0]} | {i: i for i in isas[1:]}
            sessions = {n: kernel_session(m, args.threads, library, paths[n]) for n, m in kernels.items()} | sessions
        for m in rows_m:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ms = medians(sessions, x, args.repeats, args.warmup)
            row = {"model": model, "linear": linear, "K": k, "N": n, "format": kind, "M": m}
            row |= {name: ms.get(name) for name in methods}
            out.append(row)
            cells = " ".join(f"{ms[name]:8.4f}" if name in ms else f"{'-':>8}" for name in methods)
            ratios = ""
            if "kernel" in ms:
                ratios = f" {ms['fp32'] / ms['kernel']:9.2f} {ms['nbits4'] / ms['kernel']:8.2f}"
            print(f"{model:<13} {linear:<8} {f'{k}->{n}':<11} {kind:<5} {m:>3} {cells}{ratios}", flush=True)
        del sessions
    if args.json:
        meta = {"onnxruntime": ort.__version__, "threads": args.threads, "overhead_ms": base, "onnx": onnx.__version__}
        meta["isa"] = isas
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()

"""What bounds a drafting round on this CPU: the bytes the drafter's stages read a call, the core's streaming read
rate, and each stage's call warm (its weights in the caches: what the kernels and the session cost) and cold (after
a sweep of memory larger than the last-level cache, as the target's step leaves it in the decode loop). A stage
cannot run faster than its bytes at the streaming rate, nor than its warm call; the cold call is what a round pays.

    python benchmarks/drafting_floor.py --quant int8,int4
    python benchmarks/drafting_floor.py --export DIR --past 300 --calls 40
"""

import argparse
import json
import statistics
import time

import numpy as np
import onnx
from onnx import numpy_helper
from op_profile import drafter_feeds
from verify_cost import add_export_args, exports_from

from dtrt.runtime.backends.onnxruntime import make_session

PACKED_4BIT = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
SWEEP_MB = 256  # more than any last-level cache of a machine this runs on, less than the target's weights


def stream_rate(buf: np.ndarray, repeats: int = 5) -> float:
    """GB/s one core reads at, summing a buffer far larger than the caches."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / min(times) / 1e9


def stage_bytes(path, rows: int) -> int:
    """Bytes of the stage's weights a call reads: every initializer, but of a table that is only gathered from (an
    embedding) just the rows gathered."""
    graph = onnx.load(str(path), load_external_data=True).graph
    users: dict[str, set[str]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            users.setdefault(name, set()).add(node.op_type if not (node.op_type == "Gather" and i == 0) else "table")
    total = 0.0
    for init in graph.initializer:
        arr = numpy_helper.to_array(init)  # int4 unpacked, a byte an element
        size = arr[0].size * rows if users.get(init.name) == {"table"} else arr.size
        total += size * (0.5 if init.data_type in PACKED_4BIT else arr.itemsize)
    return int(total)


def timed(sess, feeds, calls: int, sweep: np.ndarray | None) -> float:
    times = []
    for _ in range(calls):
        if sweep is not None:
            sweep.sum()
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_export_args(ap, "int8,int4")
    ap.add_argument("--kind", default="domino", help="the drafter whose stages are timed")
    ap.add_argument("--rows", type=int, default=1, help="rows the block asks for (a budget-1 round: 1)")
    ap.add_argument("--accepted", type=int, default=2, help="rows the context stage commits (tau of a round)")
    ap.add_argument("--past", type=int, default=300, help="draft-cache positions")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    sweep = np.ones(SWEEP_MB << 18, dtype=np.float32)
    rate = stream_rate(sweep)
    print(f"streaming read, one core: {rate:.1f} GB/s")
    results = {"stream_gb_s": rate, "exports": {}}
    for name, exp in exports_from(args).items():
        rows = {}
        for part, n in (("context", args.accepted), ("block", args.rows)):
            stage = f"{args.kind}.{part}"
            feeds = drafter_feeds(exp, stage, n, args.past, np.random.default_rng(0))
            block = exp.manifest["drafters"][args.kind].get("block_size", 8)
            nbytes = stage_bytes(exp.stage(stage), block if part == "block" else n)
            sess = make_session(exp.stage(stage), args.threads)
            timed(sess, feeds, 5, None)
            warm, cold = timed(sess, feeds, args.calls, None), timed(sess, feeds, args.calls, sweep)
            rows[stage] = {"mb": nbytes / 1e6, "floor_ms": nbytes / rate / 1e6, "warm_ms": warm, "cold_ms": cold}
        total = {k: sum(r[k] for r in rows.values()) for k in ("mb", "floor_ms", "warm_ms", "cold_ms")}
        results["exports"][name] = {"stages": rows, "round": total}
        where = f"rows {args.rows}, accepted {args.accepted}, draft cache {args.past}, {args.threads} thread(s)"
        print(f"\n## {name} ({where})")
        print("| stage | weights read, MB | bytes at the streaming rate, ms | warm call, ms | cold call, ms |")
        print("|---|---|---|---|---|")
        for stage, r in {**rows, "a round's drafting": total}.items():
            print(f"| {stage} | {r['mb']:.1f} | {r['floor_ms']:.2f} | {r['warm_ms']:.2f} | {r['cold_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

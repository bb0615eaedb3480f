"""Where a target call's time goes on ONNX Runtime's CPU provider: its profiler's per-node times summed by operator
type over decode-sized calls (N new tokens over a past of P, as the runtime feeds them), beside the call's wall
time; the difference is what the session spends outside its kernels (scheduling, allocation, copying inputs).

    python benchmarks/op_profile.py --quant int8,int4            # the first-use exports of smollm2-135m
    python benchmarks/op_profile.py --export DIR --n 2 --past 256 --calls 50
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import numpy as np
import onnx
from verify_cost import add_export_args, chain_feeds, exports_from

from dtrt.runtime.backends.onnxruntime import make_session


def profile(exp, n: int, past: int, calls: int, threads: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        make_session(exp.stage("target"), threads, optimized=optimized)  # the graph as ONNX Runtime runs it
        graph = onnx.load(optimized, load_external_data=False).graph
        nodes = collections.Counter(node.op_type for node in graph.node)
        sess = make_session(exp.stage("target"), threads)
        feeds = chain_feeds(exp, n, past, np.random.default_rng(seed))
        for _ in range(5):
            sess.run(["logits"], feeds)
        plain = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sess.run(["logits"], feeds)
            plain.append(time.perf_counter() - t0)
        # the profiled session times the same calls with its per-node events on
        profiled = make_session(exp.stage("target"), threads, profile=os.path.join(tmp, "profile"))
        for _ in range(5 + calls):
            profiled.run(["logits"], feeds)
        events = json.load(open(profiled.end_profiling()))
    per_op: dict[str, float] = collections.defaultdict(float)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][5:]
    first = min(e["ts"] for e in runs)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            per_op[e["args"]["op_name"]] += e["dur"] / calls
    return {
        "nodes": dict(nodes),
        "wall_us": statistics.median(plain) * 1e6,
        "profiled_us": statistics.median(e["dur"] for e in runs),
        "op_us": dict(per_op),
    }


def report(name: str, r: dict) -> str:
    kernels = sum(r["op_us"].values())
    lines = [
        f"## {name}: {sum(r['nodes'].values())} nodes; a call {r['wall_us'] / 1e3:.2f} ms (profiled "
        f"{r['profiled_us'] / 1e3:.2f} ms), kernels {kernels / 1e3:.2f} ms, the rest "
        f"{(r['profiled_us'] - kernels) / 1e3:.2f} ms",
        "",
        "| op | nodes | us per call | share of kernels |",
        "|---|---|---|---|",
    ]
    for op, us in sorted(r["op_us"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {op} | {r['nodes'].get(op, '?')} | {us:.0f} | {us / kernels:.1%} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_export_args(ap, "int8,int4")
    ap.add_argument("--n", type=int, default=2, help="new tokens per call (2: a quantized target's AR step)")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    exports = exports_from(args)
    results = {
        name: profile(exp, args.n, args.past, args.calls, args.threads, args.seed) for name, exp in exports.items()
    }
    for name, r in results.items():
        print(report(f"{name}, N={args.n}, past {args.past}, {args.threads} thread(s)", r) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

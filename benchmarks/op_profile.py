"""Where a stage call's time goes on ONNX Runtime's CPU provider: its profiler's per-node times summed by operator
type over decode-sized calls, beside the call's wall time; the difference is what the session spends outside its
kernels (scheduling, allocation, copying inputs). The target (`--stage target`, the default): N new tokens over a
past of P, as the runtime feeds them; a drafter's block (`--stage domino.block`): N rows asked for over a draft
cache of P positions; its context (`--stage domino.context`): N committed rows.

    python benchmarks/op_profile.py --quant int8,int4            # the first-use exports of smollm2-135m
    python benchmarks/op_profile.py --export DIR --n 2 --past 256 --calls 50
    python benchmarks/op_profile.py --quant int4 --stage domino.block --n 1 --past 300,1500,3000
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
import torch
from verify_cost import add_export_args, chain_feeds, exports_from

from dtrt.runtime.backends.exported import block_feeds
from dtrt.runtime.backends.onnxruntime import make_session


def drafter_feeds(exp, stage: str, n: int, past: int, rng) -> dict:
    """A drafter stage's inputs: the block asking for n rows over a draft cache of `past` positions (random K/V),
    or the context over n committed rows at positions past..past+n-1."""
    kind, _, part = stage.partition(".")
    d = exp.manifest["drafters"][kind]
    if part == "context":
        width = len(d["target_layer_ids"]) * exp.manifest["target"]["hidden_size"]
        return {"hidden": rng.standard_normal((n, width), np.float32), "positions": np.arange(past, past + n)}
    shape = (past, d["num_kv_heads"], d["head_dim"])
    cache_k, cache_v = (
        [torch.from_numpy(rng.standard_normal(shape, np.float32)) for _ in range(d["num_layers"])] for _ in "kv"
    )
    feeds = block_feeds(1, past, min(n, d["k_draft"]), cache_k, cache_v)
    return {name: t.numpy() for name, t in feeds.items()}


def profile(exp, n: int, past: int, calls: int, threads: int, seed: int, stage: str = "target") -> dict:
    rng = np.random.default_rng(seed)
    feeds = chain_feeds(exp, n, past, rng) if stage == "target" else drafter_feeds(exp, stage, n, past, rng)
    feeds = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in feeds.items()}  # a bare session's inputs
    outputs = ["logits"] if stage == "target" else None
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        make_session(exp.stage(stage), threads, optimized=optimized)  # the graph as ONNX Runtime runs it
        graph = onnx.load(optimized, load_external_data=False).graph
        nodes = collections.Counter(node.op_type for node in graph.node)
        sess = make_session(exp.stage(stage), threads)
        for _ in range(5):
            sess.run(outputs, feeds)
        plain = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sess.run(outputs, feeds)
            plain.append(time.perf_counter() - t0)
        # the profiled session times the same calls with its per-node events on
        profiled = make_session(exp.stage(stage), threads, profile=os.path.join(tmp, "profile"))
        for _ in range(5 + calls):
            profiled.run(outputs, feeds)
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
    ap.add_argument("--stage", default="target", help="target, or a drafter's <kind>.block / <kind>.context")
    ap.add_argument(
        "--n", type=int, default=2, help="new tokens per call (2: a quantized target's AR step); a block's rows"
    )
    ap.add_argument("--past", default="256", help="comma list of past lengths")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    exports = exports_from(args)
    results = {
        f"{name}, {args.stage}, N={args.n}, past {past}, {args.threads} thread(s)": profile(
            exp, args.n, past, args.calls, args.threads, args.seed, args.stage
        )
        for name, exp in exports.items()
        for past in map(int, args.past.split(","))
    }
    for name, r in results.items():
        print(report(name, r) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

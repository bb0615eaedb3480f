"""The target's verify cost per quantization: milliseconds of one target call of N new tokens over a past of P,
as the runtime makes it (through its stage runner, a quantized target's one-row calls padded to its min_rows, its
MatMulNBits kernels at accuracy level 4), side by side in one process: every repeat runs every export in turn,
the order rotating.

The ratio to N=1 is what decides a budget: a tree of N nodes pays for itself while tau tokens per round cost less
than tau single-token calls, so a steep curve wants a small tree.

    python benchmarks/verify_cost.py --model smollm2-135m --quant none,int8,int4      # the first-use exports
    python benchmarks/verify_cost.py --export A --export B --threads 1,2 --json out.json
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

from dtrt.artifacts.export import load_export
from dtrt.launch import resolve_spec
from dtrt.launch.first_use import cached_export
from dtrt.launch.start import load_pair
from dtrt.runtime.backends.exported import pad_rows
from dtrt.runtime.backends.kv import past_feeds
from dtrt.runtime.backends.onnxruntime import MATMUL_ACCURACY, OrtRunner

NS = (1, 2, 3, 5, 9, 17, 33)
PASTS = (128, 1024)


def chain_feeds(exp, n: int, past: int, rng) -> dict:
    """A chain of n new tokens over a random past, padded as the runtime pads it."""
    t = exp.manifest["target"]
    ids, positions = rng.integers(0, t["vocab_size"], n), np.arange(past, past + n)
    mask = np.tril(np.ones((n, n), bool))
    rows = (exp.manifest.get("ordered_attention") or {}).get("min_rows", 1)
    if n < rows:
        ids, positions, mask = (x.numpy() for x in pad_rows(*map(torch.from_numpy, (ids, positions, mask)), rows))
    # the runtime's cache: room for the new tokens after the past
    kv = rng.standard_normal((t["num_layers"], t["num_kv_heads"], past + n, t["head_dim"])).astype(np.float32)
    return {"ids": ids, "positions": positions, "mask": mask, **past_feeds(kv, kv.copy(), past)}


def measure(
    exports: dict,
    ns,
    pasts,
    threads,
    repeats: int,
    warmup: int,
    seed: int,
    *,
    accuracy=MATMUL_ACCURACY,
    kernels: dict | None = None,
) -> list[dict]:
    """`kernels`: name -> whether that entry may run dtrt's ONNX Runtime kernel (default: yes, where it is built)."""
    rows = []
    rng = np.random.default_rng(seed)
    kernels = kernels or {}
    for t in threads:
        runners = {
            name: OrtRunner(e, threads=t, accuracy=accuracy, kernels=kernels.get(name, True))
            for name, e in exports.items()
        }
        for runner in runners.values():
            runner.open("target")
        for past in pasts:
            for n in ns:
                feeds = {name: chain_feeds(exp, n, past, rng) for name, exp in exports.items()}
                times = {name: [] for name in exports}
                names = list(exports)
                for i in range(warmup + repeats):
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        t0 = time.perf_counter()
                        runners[name]("target", **feeds[name])
                        if i >= warmup:
                            times[name].append(time.perf_counter() - t0)
                for name in names:
                    ms = statistics.median(times[name]) * 1e3
                    rows.append({"quant": name, "threads": t, "past": past, "n": n, "ms": ms})
    ones = {(r["quant"], r["threads"], r["past"]): r["ms"] for r in rows if r["n"] == 1}
    for r in rows:  # the ratio to the same export's N=1 call
        r["over_n1"] = r["ms"] / ones[r["quant"], r["threads"], r["past"]] if ones else None
    return rows


def table(rows: list[dict], ns) -> str:
    lines = ["| threads | past | quant | " + " | ".join(f"N={n}" for n in ns) + " |"]
    lines.append("|---" * (3 + len(ns)) + "|")
    keys = list(dict.fromkeys((r["threads"], r["past"], r["quant"]) for r in rows))
    for t, p, q in keys:
        cells = [next(r for r in rows if (r["threads"], r["past"], r["quant"], r["n"]) == (t, p, q, n)) for n in ns]
        text = [f"{c['ms']:.1f}" + (f" ({c['over_n1']:.2f}x)" if c["over_n1"] else "") for c in cells]
        lines.append(f"| {t} | {p} | {q} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def add_export_args(ap, quants: str):
    """--model/--quant (a registry model's first-use exports) or --export (repeatable): what a benchmark times."""
    ap.add_argument("--model", default="smollm2-135m", help="registry model whose first-use exports to time")
    ap.add_argument("--quant", default=quants, help="comma list of quantizations (with --model)")
    ap.add_argument("--export", action="append", help="an export directory to time instead (repeatable)")


def exports_from(args) -> dict:
    """Name -> Export for add_export_args' flags; exports of one quantization are told apart by their paths."""
    if not args.export:
        pair = load_pair(resolve_spec(model=args.model, backend="onnxruntime"))
        return {q: cached_export(pair, args.model, print, q) for q in args.quant.split(",")}
    exports = [load_export(path) for path in args.export]
    names = [f"{e.quant_name} ({e.path.name})" for e in exports]
    if len(set(names)) < len(names):
        names = [f"{e.quant_name} ({e.path})" for e in exports]
    return dict(zip(names, exports))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_export_args(ap, "none,int8,int4")
    ap.add_argument("--n", default=",".join(map(str, NS)), help="new tokens per call")
    ap.add_argument("--past", default=",".join(map(str, PASTS)), help="past lengths")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--accuracy", type=int, default=MATMUL_ACCURACY, help="MatMulNBits accuracy level (4: int8 activations)"
    )
    ap.add_argument(
        "--kernel",
        action="store_true",
        help="time each export twice: with dtrt's ONNX Runtime kernel for the ordered attention and without",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    exports, kernels = exports_from(args), None
    if args.kernel:
        exports = {f"{n}{k}": e for n, e in exports.items() for k in ("", " + kernel")}
        kernels = {n: n.endswith(" + kernel") for n in exports}
    rows = measure(
        exports,
        ints(args.n),
        ints(args.past),
        ints(args.threads),
        args.repeats,
        args.warmup,
        args.seed,
        accuracy=args.accuracy,
        kernels=kernels,
    )
    print("milliseconds per target call (ratio to the same export's N=1)")
    print(table(rows, ints(args.n)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

"""Acceptance of the same methods on several exports of one target (drafter variants: quantized stages, retrained
drafters), greedy, on the first turn of the bench's seeded prompt subsets. Tau at T=0 does not depend on timing, so
this runs on a busy machine; it also checks that every export gives the same tokens (the target decides them).

    python benchmarks/drafter_tau.py --export a=exports/x --export b=exports/y --methods dominotree,dflash,domino
"""

import argparse
import json
import statistics

import torch

from dtrt.bench.contenders import render
from dtrt.bench.datasets import load
from dtrt.launch import resolve_spec
from dtrt.launch.start import pipeline
from dtrt.runtime.sampling import SamplingConfig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", action="append", required=True, help="NAME=DIR (repeatable)")
    ap.add_argument("--methods", default="dominotree,dflash,domino")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exports = dict(e.split("=", 1) for e in args.export)
    prompts = [(d, p) for d in args.datasets.split(",") for p in load(d, args.prompts)]
    rows, tokens = [], {}
    for name, path in exports.items():
        for method in args.methods.split(","):
            spec = resolve_spec(export=path, backend="onnxruntime", method=method, threads=args.threads)
            pipe = pipeline(spec)
            taus = {}
            for dataset, p in prompts:
                text = render(pipe.tokenizer, [], p.turns[0])
                out = pipe.generate(
                    pipe.tokenizer.encode(text, add_special_tokens=False), args.max_new_tokens, SamplingConfig()
                )
                taus.setdefault(dataset, []).append(out.stats()["tau"])
                tokens.setdefault((method, dataset, p.id), {})[name] = tuple(out.tokens)
            row = {"export": name, "method": method} | {d: statistics.mean(t) for d, t in taus.items()}
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    same = sum(len(set(v.values())) == 1 for v in tokens.values())
    print(f"the same tokens on every export: {same} of {len(tokens)} generations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "same_tokens": same, "generations": len(tokens), "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

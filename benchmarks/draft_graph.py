"""Drafting + DominoTree frontier build per round on the torch backend: eager vs one CUDA graph (--cuda-graph),
side by side in one process (the two alternate prompt by prompt and swap who goes first).

Per round, eager counts draft + build time; the graph counts its replay and the read-back of the tree (its
draft time, which includes the build). Both read the same tree back to the host, so the figures compare like
with like. Also: tok/s over the whole generation, and whether both gave the same tokens.

    python benchmarks/draft_graph.py                                     # tiny pair on cuda
    python benchmarks/draft_graph.py --model qwen3-4b --model-dir /models --dtype bf16 --budget 32 --json out.json
    python benchmarks/draft_graph.py --device cpu --prompts 2            # the fixed-shape step eagerly, on the CPU
"""

import argparse
import json
import statistics
from dataclasses import replace

from dtrt.launch import open_sources, resolve_spec
from dtrt.runtime.methods import make_method
from dtrt.runtime.pipeline import open_pipeline
from dtrt.runtime.sampling import SamplingConfig

PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "Write a short story about a robot who learns to",
    "import numpy as np\n\ndef softmax(x):\n",
    "Explain why the sky is blue.",
    "1, 2, 3, 5, 8, 13,",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-dir")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    base = resolve_spec(
        model=args.model, model_dir=args.model_dir, dtype=args.dtype, device=args.device, backend="torch"
    )
    sources = open_sources(base)
    model = base.model
    pipes = {}
    for name, graph in (("eager", False), ("graph", True)):
        spec = replace(base, method="dominotree", budget=args.budget, builder="frontier")
        pipe = open_pipeline(spec, sources)
        # the graph method's fixed-shape step: captured on cuda, run eagerly elsewhere (the spec needs cuda to say so)
        pipe.method = make_method(replace(spec, cuda_graph=graph, device="cuda" if graph else spec.device))
        pipes[name] = pipe
    prompts = [pipes["eager"].tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[: args.prompts]]
    sampling = SamplingConfig()
    for pipe in pipes.values():  # warm-up: kernel compilation, the first capture
        pipe.generate(prompts[0], 16, sampling)

    per_round = {n: [] for n in pipes}
    tok_s = {n: [] for n in pipes}
    same = 0
    for i, ids in enumerate(prompts):
        order = list(pipes) if i % 2 == 0 else list(pipes)[::-1]
        tokens = {}
        for name in order:
            g = pipes[name].generate(ids, args.max_new_tokens, sampling)
            per_round[name] += [(r.draft_s + r.build_s) * 1e3 for r in g.rounds]
            tok_s[name].append(g.tokens_per_s)
            tokens[name] = g.tokens
        same += tokens["eager"] == tokens["graph"]

    rows = {
        n: {
            "draft_build_median_ms": statistics.median(per_round[n]),
            "draft_build_p90_ms": sorted(per_round[n])[int(0.9 * (len(per_round[n]) - 1))],
            "tok_s_median": statistics.median(tok_s[n]),
            "rounds": len(per_round[n]),
        }
        for n in pipes
    }
    print(
        f"{model} on {args.device}, dominotree frontier budget {args.budget}, {len(prompts)} prompts x "
        f"{args.max_new_tokens} tokens; same tokens {same}/{len(prompts)}\n"
    )
    print("| mode | draft + build median ms | p90 ms | tok/s median | rounds |")
    print("|---|---:|---:|---:|---:|")
    for n, r in rows.items():
        print(
            f"| {n} | {r['draft_build_median_ms']:.3f} | {r['draft_build_p90_ms']:.3f} | {r['tok_s_median']:.1f} | "
            f"{r['rounds']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": vars(args), "same_tokens": same, "prompts": len(prompts), "results": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()

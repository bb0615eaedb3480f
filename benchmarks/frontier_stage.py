"""DominoTree's tree build per round on ONNX Runtime: the host heap over the scorer stages against one call of the
exported frontier stage (--builder frontier), on the rounds of real generations.

The rounds (drafter rows and root) are captured from heap generations, then each round's tree is built both ways,
alternating which goes first, in one process. Reported: median and p90 ms per round, and how many trees agree.

    python benchmarks/frontier_stage.py                                   # the embedded default (SmolLM2)
    python benchmarks/frontier_stage.py --model tiny --threads 1 --json out.json
"""

import argparse
import json
import statistics
import time

import torch

from dtrt.errors import DtrtError
from dtrt.launch import open_sources, resolve_spec
from dtrt.runtime.methods import DominoTree
from dtrt.runtime.pipeline import open_pipeline
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import Round

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue.",
    "Give three tips for writing clear emails.",
    "What is the capital of France, and what is it known for?",
    "def fibonacci(n):\n",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def capture_rounds(pipe, prompts, max_new_tokens) -> list[Round]:
    rounds, real = [], DominoTree.build

    def build(self, backend, rnd):
        rounds.append(Round(rnd.ph.clone(), rnd.base.clone(), rnd.root.clone()))
        return real(self, backend, rnd)

    DominoTree.build = build
    try:
        for ids in prompts:
            pipe.generate(ids, max_new_tokens, SamplingConfig())
    finally:
        DominoTree.build = real
    return rounds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="registry name (default: the embedded default)")
    ap.add_argument("--export", help="export directory (default: the registry model's cached export)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timings per round and builder (the median is kept)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    base = resolve_spec(model=args.model, export=args.export, backend="onnxruntime", threads=args.threads)
    sources = open_sources(base)
    budget = sources.export.manifest["budget"]  # the frontier stage's, fixed at export
    pipes = {
        b: open_pipeline(resolve_spec(**sources_flags(base), method="dominotree", builder=b, budget=budget), sources)
        for b in ("heap", "frontier")
    }
    tok = pipes["heap"].tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[: args.prompts]]
    rounds = capture_rounds(pipes["heap"], prompts, args.max_new_tokens)
    for pipe in pipes.values():
        pipe.method.prepare(pipe.backend, pipe.backend.drafter.cfg.k_draft)
        pipe.method.build(pipe.backend, rounds[0])  # warm-up

    times = {b: [] for b in pipes}
    same = 0
    for i, rnd in enumerate(rounds):
        trees = {}
        for b in list(pipes) if i % 2 == 0 else list(pipes)[::-1]:
            pipe, best = pipes[b], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                trees[b] = pipe.method.build(pipe.backend, rnd)
                best.append(time.perf_counter() - t0)
            times[b].append(statistics.median(best) * 1e3)
        same += bool(torch.equal(trees["heap"].tokens, trees["frontier"].tokens)) and bool(
            torch.equal(trees["heap"].parents, trees["frontier"].parents)
        )
    rows = {
        b: {"median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))]} for b, t in times.items()
    }
    name = base.model or sources.export.path.name
    print(
        f"{name} on onnxruntime, {args.threads} thread(s), budget {budget}: {len(rounds)} rounds from "
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens; same tree on {same}/{len(rounds)} rounds\n"
    )
    print("| builder | median ms / round | p90 ms |")
    print("|---|---:|---:|")
    for b, r in rows.items():
        label = "host heap (scorer stages)" if b == "heap" else "frontier stage (one call)"
        print(f"| {label} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rounds": len(rounds), "same_tree": same, "results": rows}, f, indent=2)


def sources_flags(spec) -> dict:
    return {"model": spec.model, "export": spec.export, "backend": spec.backend, "threads": spec.threads}


if __name__ == "__main__":
    try:
        main()
    except DtrtError as e:
        raise SystemExit(f"error: {e}") from None

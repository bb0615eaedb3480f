"""DominoTree build time per round: heap vs frontier, side by side in one process.

Random weights at Qwen3-4B Domino shapes by default (V=151936, H=2560, G=1024, E=256; M=64, k=8, D=16).
A round is the scorer's per-round setup plus the build, on fresh random drafter rows and base logits; the
two builders alternate who goes first, and "same tree" counts rounds where both chose the same nodes.
On a CPU both builders are bound by streaming the GRU weights: the heap streams them once per pop (B times,
k rows each), the frontier once per depth (D - 1 times, W = B rows each). With --device cuda the builders run
on the GPU, and the Domino scores and the frontier's selection on their Triton kernels (dtrt.ops.kernels;
DTRT_KERNELS=ref times the PyTorch references instead): there the heap pays a host sync per pop.

    python benchmarks/tree_build.py
    python benchmarks/tree_build.py --vocab 32000 --hidden 1024 --gru 512 --emb 128 --rounds 10 --json out.json
"""

import argparse
import json
import math
import statistics
import time

import torch
from torch import nn

from dtrt.models.domino import DominoHead
from dtrt.scoring import DominoScorer
from dtrt.tree import Round, build_frontier, build_heap

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def p90(xs: list[float]) -> float:
    return sorted(xs)[math.ceil(0.9 * len(xs)) - 1]


def same_tree(a, b) -> bool:
    """The heap's tree is built on the host, the frontier's stays on the device: compared on the host."""
    return all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()) for f in ("tokens", "parents", "depths"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--gru", type=int, default=1024)
    ap.add_argument("--emb", type=int, default=256)
    ap.add_argument("--topm", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=1)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (timings synchronize before and after a build)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype, V, D = DTYPES[args.dtype], args.vocab, args.depth

    dev = torch.device(args.device)
    head = DominoHead(args.hidden, args.gru, args.emb, V).to(dev, dtype).eval()
    embed = nn.Embedding(V, args.hidden).to(dev, dtype).eval()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {(b, name): [] for b in args.budgets for name in ("heap", "frontier")}
    agree = {b: 0 for b in args.budgets}

    def run(name: str, rnd: Round, budget: int):
        sync()
        t0 = time.perf_counter()
        scorer = DominoScorer(rnd, head, embed, args.k, args.topm, args.prefix_len)
        if name == "heap":
            tree = build_heap(scorer, budget, D)
        else:
            tree = build_frontier(scorer, budget, D, mask_token_id=V - 1).tree(0)
        sync()
        return tree, time.perf_counter() - t0

    for r in range(args.warmup + args.rounds):
        rnd = Round(
            torch.randn(1, D, args.hidden).to(dev, dtype),
            3 * torch.randn(1, D, V, device=dev),
            torch.randint(0, V, (1,), device=dev),
        )
        for budget in args.budgets:
            order = ("heap", "frontier") if r % 2 == 0 else ("frontier", "heap")
            trees = {}
            for name in order:
                trees[name], dt = run(name, rnd, budget)
                if r >= args.warmup:
                    times[budget, name].append(dt * 1e3)
            if r >= args.warmup:
                agree[budget] += same_tree(trees["heap"], trees["frontier"])

    rows = []
    for b in args.budgets:
        h, f = times[b, "heap"], times[b, "frontier"]
        rows.append(
            {
                "budget": b,
                "heap_median_ms": statistics.median(h),
                "heap_p90_ms": p90(h),
                "frontier_median_ms": statistics.median(f),
                "frontier_p90_ms": p90(f),
                "frontier_over_heap": statistics.median(f) / statistics.median(h),
                "same_tree": agree[b],
                "rounds": args.rounds,
            }
        )

    print(
        f"V={V} H={args.hidden} G={args.gru} E={args.emb} M={args.topm} k={args.k} D={D} "
        f"prefix_len={args.prefix_len} {args.dtype} on {dev}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds after {args.warmup} warm-up\n"
    )
    print(
        "| budget | heap median ms | heap p90 ms | frontier median ms | frontier p90 ms | frontier / heap | same tree |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['budget']} | {row['heap_median_ms']:.2f} | {row['heap_p90_ms']:.2f} | "
            f"{row['frontier_median_ms']:.2f} | {row['frontier_p90_ms']:.2f} | {row['frontier_over_heap']:.2f}x | "
            f"{row['same_tree']}/{row['rounds']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": torch.get_num_threads(), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

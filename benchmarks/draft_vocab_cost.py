"""What a reduced draft vocabulary saves: milliseconds of the drafter's block stage on ONNX Runtime (int8 weights, as
the first-use export runs it, or fp32) for each vocabulary, at a few row counts, over a past of P positions. Each
vocabulary's block is exported alone (dtrt.exporter.stage_modules.DrafterBlockStage with
dtrt.models.draft_vocab.DraftHead) and every repeat calls each (vocabulary, rows) in turn, the order rotating, so
load drifts alike on all of them.

    python benchmarks/draft_vocab_cost.py --draft-vocab 32k=d2t-32768.safetensors --draft-vocab 8k=d2t-8192.safetensors
"""

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dtrt.exporter.onnx_export import export_stage
from dtrt.exporter.quantize import quantize_stage
from dtrt.exporter.stage_modules import drafter_stages
from dtrt.launch import resolve_spec
from dtrt.launch.start import load_pair
from dtrt.models.checkpoint import load_drafter, load_target
from dtrt.models.draft_vocab import load_draft_vocab
from dtrt.runtime.backends.exported import block_feeds
from dtrt.runtime.backends.onnxruntime import cpu_session


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-vocab", action="append", default=[], help="NAME=FILE (repeatable); `full` always runs")
    ap.add_argument("--rows", default="1,2,4,7")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fp32", action="store_true", help="the fp32 block (default: int8 weights, as the first use)")
    ap.add_argument("--json")
    args = ap.parse_args()
    pair = load_pair(resolve_spec(model=args.model, backend="torch"))
    target, drafter = load_target(pair.target), load_drafter(pair.domino)
    vocabs = {"full": None} | {
        v.split("=", 1)[0]: load_draft_vocab(v.split("=", 1)[1], target.cfg.vocab_size) for v in args.draft_vocab
    }
    rows = [int(r) for r in args.rows.split(",")]
    cfg = drafter.cfg
    gen = torch.Generator().manual_seed(0)
    kv = (args.past, cfg.num_kv_heads, cfg.head_dim)
    cache_k, cache_v = ([torch.randn(kv, generator=gen) for _ in range(cfg.num_layers)] for _ in "kv")
    feed = {name: t.numpy() for name, t in block_feeds(17, args.past, 1, cache_k, cache_v).items()}  # rows: per case
    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, vocab in vocabs.items():
            block = drafter_stages(target, drafter, "domino", vocab)[1]
            path = Path(tmp) / f"{name}.onnx"
            export_stage(block, path, 64, args.past + 64)
            if not args.fp32:
                quantize_stage(path)
            sessions[name] = cpu_session(path, args.threads)
        cases = list(itertools.product(sessions, rows))
        times = {c: [] for c in cases}
        for i in range(args.warmup + args.repeats):
            for name, r in cases[i % len(cases) :] + cases[: i % len(cases)]:
                t0 = time.perf_counter()
                sessions[name].run(None, {**feed, "rows": np.array([r], dtype=np.int64)})
                if i >= args.warmup:
                    times[(name, r)].append(time.perf_counter() - t0)
    ms = {c: statistics.median(t) * 1e3 for c, t in times.items()}
    kind = "fp32" if args.fp32 else "int8"
    print(f"{args.model} {kind} block, {args.threads} thread(s), past {args.past}: median ms of {args.repeats} calls")
    print("| vocabulary | tokens | " + " | ".join(f"rows {r}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for name, vocab in vocabs.items():
        size = vocab.size if vocab is not None else target.cfg.vocab_size
        cells = [f"{ms[(name, r)]:.2f} ({ms[(name, r)] / ms[('full', r)]:.2f}x)" for r in rows]
        print(f"| {name} | {size} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": {f"{n}@{r}": v for (n, r), v in ms.items()}, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

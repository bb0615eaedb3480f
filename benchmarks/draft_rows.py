"""The drafter's block as a round asks for it: milliseconds of one `draft_block` on ONNX Runtime for a few row
counts (`full`: every proposal row, k_draft), over a committed past of P positions, interleaved (every repeat calls
each row count in turn, the order rotating) so load drifts alike on all of them. The lm_head over the rows asked
is most of the block's cost: fewer rows, a cheaper round.

    python benchmarks/draft_rows.py                                # the SmolLM2 first-use export (int8 drafter)
    python benchmarks/draft_rows.py --export DIR --kind dflash --rows full,1,2,4 --json out.json
"""

import argparse
import json
import statistics
import time

import torch

from dtrt.artifacts.export import load_export
from dtrt.launch import resolve_spec
from dtrt.launch.first_use import cached_export
from dtrt.launch.start import load_pair
from dtrt.runtime.backends.onnxruntime import OrtBackend


def measure(backend, rows: list[int], past: int, repeats: int, warmup: int, seed: int) -> dict[int, float]:
    """Row count -> median milliseconds of draft_block over `past` committed positions of random tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = backend.target_dims["vocab_size"]
    backend.reset(past + backend.drafter.cfg.block_size + 2)
    ids = torch.randint(0, vocab, (past,), generator=gen)
    _, hidden = backend.target_forward(ids, torch.arange(past), torch.ones(past, past, dtype=torch.bool).tril())
    backend.commit(torch.arange(past))
    backend.draft_context(hidden, torch.arange(past))
    times = {r: [] for r in rows}
    for i in range(warmup + repeats):
        for r in rows[i % len(rows) :] + rows[: i % len(rows)]:
            t0 = time.perf_counter()
            backend.draft_block(int(ids[i % past]), past, rows=r)
            if i >= warmup:
                times[r].append(time.perf_counter() - t0)
    return {r: statistics.median(t) * 1e3 for r, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry model whose first-use export to time")
    ap.add_argument("--export", help="an export directory to time instead")
    ap.add_argument("--kind", default="domino", help="the drafter: dflash or domino")
    ap.add_argument("--rows", default="full,2", help="comma list of row counts (full: k_draft)")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.export:
        exp = load_export(args.export)
    else:
        exp = cached_export(load_pair(resolve_spec(model=args.model, backend="onnxruntime")), args.model, print)
    torch.set_num_threads(args.threads)
    backend = OrtBackend(exp, args.kind, threads=args.threads)
    k_draft = backend.drafter.cfg.k_draft
    rows = [k_draft if r == "full" else int(r) for r in args.rows.split(",")]
    ms = measure(backend, rows, args.past, args.repeats, args.warmup, args.seed)
    quant = exp.manifest.get("drafter_quant", "none")
    print(f"{exp.path}: {args.kind} block (drafter {quant}), past {args.past}, {args.threads} thread(s), "
          f"median of {args.repeats}")  # fmt: skip
    for r, m in ms.items():
        print(f"  rows {r:>2}{' (full)' if r == k_draft else ''}: {m:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": {str(r): m for r, m in ms.items()}, "k_draft": k_draft, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

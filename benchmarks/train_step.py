"""Where a `dtrt train-drafter` step's time goes, per loss: the full-vocabulary loss against the sampled loss at
several candidate counts, side by side in one process on the same batches, with the operators that dominate.

    python benchmarks/train_step.py --model smollm2-135m --data runs/smollm2/.train/data --candidates 0,8192,4096,2048

Without --data the batch is random tokens featurized by the target here. Each row: the median step (forward,
backward, optimizer) over --repeats steps, its parts, and the sampled loss against the full loss on one fixed batch.
"""

import argparse
import statistics
import time

import torch

from dtrt.launch import resolve_spec
from dtrt.launch.start import load_pair
from dtrt.models.checkpoint import load_target
from dtrt.train import store
from dtrt.train.config import TrainConfig
from dtrt.train.distill import block_loss, draw_candidates, needed_ids, sample_anchors
from dtrt.train.trainer import new_drafter, taps_for


def batch_from_target(target, cfg, gen):
    T, b = cfg.seq_len, cfg.batch
    tokens = torch.randint(0, target.cfg.vocab_size, (b, T), generator=gen)
    with torch.no_grad():
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        logits, feats = target(tokens, torch.arange(T).expand(b, T), mask, taps=taps_for(target.cfg.num_layers))
    top = logits.topk(store.TOPK, -1).indices
    return {
        "tokens": tokens,
        "lengths": torch.full((b,), T),
        "labels": torch.cat((tokens[:, :1], top[:, :-1, 0]), 1),
        "topk": torch.cat((tokens[:, :1, None].expand(-1, -1, store.TOPK), top[:, :-1]), 1),
        "feats": feats.to(torch.float16),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", help="a run's .train/data directory (default: random tokens)")
    ap.add_argument("--candidates", default="0,8192,4096,2048", help="comma-separated; 0 is the full loss")
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--anchors", type=int, default=TrainConfig.anchors)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(batch=args.batch, anchors=args.anchors)
    pair = load_pair(resolve_spec(model=args.model, backend="torch"))
    target = load_target(pair.target).requires_grad_(False)
    drafter = new_drafter(target, cfg, 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5)
    V, K = target.cfg.vocab_size, drafter.cfg.k_draft
    gen = torch.Generator().manual_seed(0)
    data = store.load(args.data) if args.data else None

    def batch():
        if data is None:
            return batch_from_target(target, cfg, gen)
        return data.rows(torch.randint(0, len(data), (cfg.batch,), generator=gen), "cpu")

    def loss_of(b, anchors, c):
        cands = draw_candidates(needed_ids(b["labels"], b["topk"], anchors, K), V, c, gen) if c else None
        return block_loss(
            target,
            drafter,
            b["tokens"],
            b["feats"],
            anchors,
            cfg.slot_decay,
            b["labels"],
            b["lengths"],
            candidates=cands,
        )[0]

    batches = [batch() for _ in range(args.repeats)]
    fixed = batches[0]
    anchors_fixed = sample_anchors(fixed["lengths"], cfg.anchors, torch.Generator().manual_seed(1))
    print(
        f"{args.model}: batch {cfg.batch} x {cfg.anchors} blocks of {drafter.cfg.block_size}, vocabulary {V}, "
        f"{args.threads} threads, {'data ' + args.data if data else 'random tokens'}"
    )
    print("| candidates | needed | step s | forward s | backward s | optimizer s | loss (fixed batch) | full loss |")
    print("|---|---|---|---|---|---|---|---|")
    for c in [int(x) for x in args.candidates.split(",")]:
        parts = {"step": [], "fwd": [], "bwd": [], "opt": []}
        needed = []
        for b in batches:
            anchors = sample_anchors(b["lengths"], cfg.anchors, gen)
            if c:
                needed.append(needed_ids(b["labels"], b["topk"], anchors, K).numel())
            t0 = time.perf_counter()
            loss = loss_of(b, anchors, c)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            for k, v in (("step", t3 - t0), ("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2)):
                parts[k].append(v)
        with torch.no_grad():
            full, est = loss_of(fixed, anchors_fixed, 0).item(), loss_of(fixed, anchors_fixed, c).item()
        med = {k: statistics.median(v) for k, v in parts.items()}
        print(
            f"| {c or 'all'} | {int(statistics.median(needed)) if needed else '-'} | {med['step']:.3f} | "
            f"{med['fwd']:.3f} | {med['bwd']:.3f} | {med['opt']:.3f} | {est:.3f} | {full:.3f} |"
        )
    from torch.profiler import ProfilerActivity, profile

    for c in (0, 4096):
        b = batches[-1]
        anchors = sample_anchors(b["lengths"], cfg.anchors, gen)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_of(b, anchors, c).backward()
        print(f"\ncandidates {c or 'all'}: the operators that take the step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))


if __name__ == "__main__":
    main()

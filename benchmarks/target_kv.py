"""What the target's K/V cache layout costs a decode step: plain decoding (one target call and its commit per
token) on the ONNX Runtime backend, with the runtime's cache appended in place (TargetKV: the stage gets the whole
buffer and the past's length) against a dense cache re-spaced on every append (DenseKV, the layout before export
layout 6, fed as a buffer that holds exactly the past). Same export, same session options, side by side in one
process: the two backends take turns, a block of steps each, at every past length.

    python benchmarks/target_kv.py                               # the embedded default (smollm2-135m, int8)
    python benchmarks/target_kv.py --quant int4 --past 128,1024,4096 --json out.json
"""

import argparse
import ctypes
import json
import statistics
import time

import torch

from dtrt.launch import resolve_spec
from dtrt.launch.first_use import cached_export
from dtrt.launch.start import load_pair
from dtrt.models.kv_buffer import appended_end
from dtrt.runtime.backends.kv import past_feeds
from dtrt.runtime.backends.onnxruntime import OrtBackend


class DenseKV:
    """The control: a dense [layers, kv_heads, length, head_dim] past, every (layer, head) row re-spaced on each
    append (one memmove per row, last row first), handed to the stage as a buffer of exactly the past."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device="cpu"):
        self.lead, self.rows, self.head_dim, self.capacity = (layers, heads), layers * heads, head_dim, capacity
        size = self.rows * capacity * head_dim
        self.k, self.v = (torch.zeros(size, dtype=dtype, device=device) for _ in range(2))
        self.length = 0

    def view(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if length is None else length
        size, shape = self.rows * n * self.head_dim, (*self.lead, n, self.head_dim)
        return self.k[:size].view(shape), self.v[:size].view(shape)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        p, n, hd = self.length, k.shape[2], self.head_dim
        q = appended_end(self.length, n, self.capacity)
        for buf, new in ((self.k, k), (self.v, v)):
            if p:
                row, base, item = p * hd * buf.element_size(), buf.data_ptr(), buf.element_size()
                for r in range(self.rows - 1, 0, -1):
                    ctypes.memmove(base + r * q * hd * item, base + r * row, row)
            buf[: self.rows * q * hd].view(self.rows, q, hd)[:, p:] = new.reshape(self.rows, n, hd)
        self.length = q

    def reset(self):
        self.length = 0

    def feeds(self, length: int | None = None) -> dict[str, torch.Tensor]:
        k, v = self.view(length)
        return past_feeds(k, v, k.shape[2])


def backend(exp, threads: int, dense: bool, capacity: int) -> OrtBackend:
    b = OrtBackend(exp, None, threads=threads)
    b.reset(capacity)
    if dense:
        t = exp.manifest["target"]
        b.cache = DenseKV(t["num_layers"], t["num_kv_heads"], t["head_dim"], capacity, b.dtype)
    return b


def step(b: OrtBackend, token: int):
    p = b.past
    b.target_forward(torch.tensor([token]), torch.tensor([p]), torch.ones(1, 1, dtype=torch.bool))
    b.commit(torch.tensor([0]))


def measure(exp, pasts, steps: int, block: int, threads: int, seed: int) -> list[dict]:
    vocab = exp.manifest["target"]["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for past in pasts:
        capacity = past + steps + 8
        pair = {"in place": backend(exp, threads, False, capacity), "dense": backend(exp, threads, True, capacity)}
        prompt = torch.randint(0, vocab, (past,), generator=gen)
        mask = torch.ones(past, past, dtype=torch.bool).tril()
        for b in pair.values():  # the same past in both
            b.target_forward(prompt, torch.arange(past), mask)
            b.commit(torch.arange(past))
        times = {name: [] for name in pair}
        tokens = torch.randint(0, vocab, (steps,), generator=gen).tolist()
        for start in range(0, steps, block):
            for name in list(pair)[(start // block) % 2 :] + list(pair)[: (start // block) % 2]:
                for token in tokens[start : start + block]:
                    t0 = time.perf_counter()
                    step(pair[name], token)
                    times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratio = ms["dense"] / ms["in place"]
        rows.append({"past": past, **{f"{k} ms": v for k, v in ms.items()}, "dense / in place": ratio})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default=None, help="the target's quantization (default: the model's)")
    ap.add_argument("--past", default="128,512,1024,2048")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per past length and cache")
    ap.add_argument("--block", type=int, default=8, help="steps in a row before the other cache takes its turn")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    spec = resolve_spec(model=args.model, backend="onnxruntime", quant=args.quant)
    exp = cached_export(load_pair(spec), args.model, print, spec.quant)
    rows = measure(exp, [int(p) for p in args.past.split(",")], args.steps, args.block, args.threads, args.seed)
    print(f"milliseconds per decode step (target call + commit), {exp.path.name}, {args.threads} thread(s)")
    print("| past | in place | dense | dense / in place |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['past']} | {r['in place ms']:.2f} | {r['dense ms']:.2f} | {r['dense / in place']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()

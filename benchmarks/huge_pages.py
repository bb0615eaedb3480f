"""Huge pages side by side: two child processes, one started plainly (DTRT_HUGE_PAGES=0) and one as the `dtrt`
command starts itself (glibc's huge-page tunable, dtrt.hugepages), each with the same pipelines open on the same
first-use export, generate the same prompts in turn, prompt by prompt and method by method, so that a noisy
machine's drift falls on both alike. Prints tok/s and milliseconds a round per method, the ratio with a paired
bootstrap 95% CI over the prompts, and checks the tokens are the same.

    python benchmarks/huge_pages.py --quant int4 --methods ar,dominotree --prompts 10
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np


def child(args):
    if args.huge:
        from dtrt.entry import restart

        restart()  # as the dtrt command does, before anything is allocated
    import torch

    from dtrt import hugepages
    from dtrt.bench.contenders import render
    from dtrt.bench.datasets import load
    from dtrt.launch import open_sources, resolve_spec
    from dtrt.runtime.pipeline import open_pipeline
    from dtrt.runtime.sampling import SamplingConfig

    torch.set_num_threads(args.threads)
    prompts = [p for d in args.datasets.split(",") for p in load(d, args.prompts)]
    pipes = {}
    for method in args.methods.split(","):
        spec = resolve_spec(model=args.model, backend="onnxruntime", quant=args.quant, threads=args.threads,
                            method=method)  # fmt: skip
        pipes[method] = open_pipeline(spec, open_sources(spec))
    tok = next(iter(pipes.values())).tokenizer
    ids = [tok.encode(render(tok, [], p.turns[0]), add_special_tokens=False) for p in prompts]
    for pipe in pipes.values():
        pipe.generate(ids[0], 16, SamplingConfig())  # warm-up
    print(json.dumps({"prompts": len(ids), "huge_mib": hugepages.resident_mib()}), flush=True)
    for line in sys.stdin:  # "METHOD INDEX": generate that prompt, answer with its stats
        method, i = line.split()
        st = pipes[method].generate(ids[int(i)], args.max_new_tokens, SamplingConfig()).stats()
        print(json.dumps({k: st[k] for k in ("decode_s", "rounds", "stage_s", "tokens")}), flush=True)


def ask(proc, line: str) -> dict:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def ratio_ci(plain: list[dict], huge: list[dict], seed: int = 0) -> tuple[float, float, float]:
    """tok/s with huge pages over tok/s without, over the prompts, with a paired bootstrap 95% CI."""
    toks = np.array([len(p["tokens"]) for p in plain])
    a, b = np.array([p["decode_s"] for p in plain]), np.array([h["decode_s"] for h in huge])
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(toks), size=(2000, len(toks)))
    boot = (toks[picks].sum(1) / b[picks].sum(1)) / (toks[picks].sum(1) / a[picks].sum(1))
    return a.sum() / b.sum(), *np.percentile(boot, [2.5, 97.5])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--methods", default="ar,dominotree")
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--huge", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DTRT_HUGE_PAGES")}
    procs = {}
    for huge in (False, True):
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:], *(["--huge"] if huge else [])]
        procs[huge] = subprocess.Popen(cmd, env={**env, "DTRT_HUGE_PAGES": "1" if huge else "0"}, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    ready = {huge: json.loads(p.stdout.readline()) for huge, p in procs.items()}
    print(f"anonymous memory in huge pages: {ready[False]['huge_mib']:.0f} MiB plainly, "
          f"{ready[True]['huge_mib']:.0f} MiB as the dtrt command starts", flush=True)  # fmt: skip
    got = {(m, h): [] for m in args.methods.split(",") for h in procs}
    for i in range(ready[False]["prompts"]):
        for m in args.methods.split(","):
            order = (False, True) if i % 2 == 0 else (True, False)  # who goes first alternates
            for huge in order:
                got[m, huge].append(ask(procs[huge], f"{m} {i}"))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    for m in args.methods.split(","):
        plain, huge = got[m, False], got[m, True]
        assert [p["tokens"] for p in plain] == [h["tokens"] for h in huge], f"{m}: the tokens differ"
        r, lo, hi = ratio_ci(plain, huge)
        line = []
        for name, runs in (("plain", plain), ("huge pages", huge)):
            rounds = sum(x["rounds"] for x in runs)
            tok_s = sum(len(x["tokens"]) for x in runs) / sum(x["decode_s"] for x in runs)
            ms = " / ".join(f"{1e3 * sum(x['stage_s'][k] for x in runs) / rounds:.2f}" for k in runs[0]["stage_s"])
            line.append(f"{name} {tok_s:.1f} tok/s ({' / '.join(runs[0]['stage_s'])} ms a round {ms})")
        print(f"{m}: {'; '.join(line)}; huge pages / plain {r:.3f}x [{lo:.3f}, {hi:.3f}], same tokens")


if __name__ == "__main__":
    main()

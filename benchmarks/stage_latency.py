"""Per-stage latency on ONNX Runtime vs PyTorch on the CPU, and the share of a decode round spent in Python outside
the stages, side by side in one process.

Stages: each exported graph against its PyTorch wrapper (dtrt.exporter.stage_modules), both through the runtime's stage
runners (ONNX Runtime's and dtrt.exporter.reference's PyTorch one) on the same random inputs, interleaved call by
call (the order alternates), medians. Rounds: real generations on both backends, alternating
prompt by prompt; a stage call is one of the backend's target_forward / commit / draft_context / draft_block or,
on ONNX Runtime, any other session run (the Domino scorer's); everything else (tree building, host scorers,
acceptance, sampling, the loop) is Python outside the stages. On ONNX Runtime the time inside session.run is
also shown: the difference to the stage calls is the backend's own host work (numpy feeds, the KV cache).

    python benchmarks/stage_latency.py                     # the tiny pair, exported to a temporary directory
    python benchmarks/stage_latency.py --export DIR --threads 1 --methods ar ddtree --json out.json
"""

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dtrt.artifacts.export import check_source, load_export
from dtrt.errors import DtrtError
from dtrt.exporter.reference import TorchStageRunner
from dtrt.exporter.stage_modules import drafter_stages, target_stage
from dtrt.launch import resolve_spec
from dtrt.launch.start import load_pair
from dtrt.models.checkpoint import load_drafter, load_target, parse_dtype
from dtrt.models.pair import Pair
from dtrt.runtime.backends.onnxruntime import OrtRunner
from dtrt.runtime.generate import Generation
from dtrt.runtime.pipeline import Sources, open_pipeline
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec

PROMPTS = ["The cat sees ", "A quick fox ", "Every king walks ", "The moon is very ", "Some old man reads "]
STAGE_CALLS = ("target_forward", "commit", "draft_context", "draft_block")


def source_pair(args, exp) -> tuple[Pair, str | None]:
    """The checkpoints behind the export: --model/--target when given (and checked), else the manifest's."""
    if args.model or args.target:
        pair = load_pair(resolve_spec(**sources(args)))
        check_source(exp, pair.target, args.model)
        return pair, args.model
    src = exp.manifest["source"]
    d = {k: Path(v["path"]) for k, v in src["drafters"].items()}
    return Pair(Path(src["target"]), d.get("dflash"), d.get("domino")), src.get("model")


def sources(args) -> dict:
    """The checkpoint flags as resolve_spec takes them."""
    return {"model": args.model, "target": args.target, "drafter": args.drafter, "model_dir": args.model_dir}


def stage_cases(args, exp, pair) -> tuple[list, TorchStageRunner, OrtRunner]:
    """(label, shape, stage name, (n, p)) for every stage of the export, and the two runners that run them: the
    PyTorch wrappers built from `pair`, ONNX Runtime over the export."""
    dtype = parse_dtype(exp.manifest["dtype"])
    target = load_target(pair.target, dtype)
    stages = [target_stage(target, tuple(exp.manifest["target"]["taps"]))]
    cases = [
        ("target prefill", f"N={args.prefill} P=0", "target", (args.prefill, 0)),
        ("target verify", f"N={args.width} P={args.past}", "target", (args.width, args.past)),
    ]
    for kind in exp.drafters:
        path = pair.dflash if kind == "dflash" else pair.domino
        context, block = drafter_stages(target, load_drafter(path, dtype), kind, exp.draft_vocab(kind))
        stages += [context, block]
        cases.append((context.name, f"n={args.context} P={args.past}", context.name, (args.context, args.past)))
        cases.append((block.name, f"P={args.past}", block.name, (1, args.past)))
    scorer = [f"domino.{s}" for s in ("scorer_root", "scorer_setup", "scorer_children", "scorer_advance", "frontier")]
    if all(s in exp.manifest["stages"] for s in scorer):
        from dtrt.exporter.scorer_stages import scorer_stages

        m = exp.manifest
        for stage in scorer_stages(target, load_drafter(pair.domino, dtype), m["budget"], m["topm"], m["node_topk"]):
            stage.name = f"domino.{stage.name}"
            stages.append(stage)
            cases.append((stage.name, "n=1", stage.name, (1, 0)))
    return cases, TorchStageRunner(exp, {s.name: s for s in stages}), OrtRunner(exp, args.threads or None)


def max_abs_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float((ref - got).abs().masked_fill(ref == got, 0).max()) if ref.numel() else 0.0  # equal infs: 0


@torch.no_grad()
def time_stages(args, cases, reference: TorchStageRunner, runner: OrtRunner):
    """Each case's stage through both runners (the runtime's `runner(stage, **feeds)` path), interleaved."""
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    for label, shape, name, (n, p) in cases:
        inputs = reference.stage(name).example(n, p, gen)
        for r in (reference, runner):
            r.open(name)
        calls = {
            "torch": lambda name=name, inputs=inputs: reference(name, **inputs),
            "onnxruntime": lambda name=name, inputs=inputs: runner(name, **inputs),
        }
        times = {k: [] for k in calls}
        for i in range(args.warmup + args.repeats):
            for backend in ("torch", "onnxruntime") if i % 2 else ("onnxruntime", "torch"):
                t0 = time.perf_counter()
                calls[backend]()
                if i >= args.warmup:
                    times[backend].append(time.perf_counter() - t0)
        # on fresh copies: a torch stage may write into its inputs (the target's cache room), which the timed calls
        # shared
        ref = reference(name, **{k: v.clone() for k, v in inputs.items()})
        got = runner(name, **{k: v.clone() for k, v in inputs.items()})
        diff = max(max_abs_diff(ref[k], got[k]) for k in ref)
        t_ms, o_ms = (statistics.median(times[k]) * 1e3 for k in ("torch", "onnxruntime"))
        rows.append(
            {
                "stage": label,
                "shape": shape,
                "torch_ms": t_ms,
                "onnxruntime_ms": o_ms,
                "torch_over_onnxruntime": t_ms / o_ms,
                "max_abs_diff": diff,
            }
        )
    return rows


class StageClock:
    """Times the backend's stage calls (and, on ONNX Runtime, every session run) of one generation's decode."""

    def __init__(self, backend):
        self.calls = self.sessions = 0.0
        self.depth = 0
        self.decoding = False
        for name in STAGE_CALLS:
            setattr(backend, name, self.wrap(getattr(backend, name), stage=True))
        if (runner := getattr(backend, "runner", None)) is not None:  # the export backends' stage runs
            runner.run = self.wrap(runner.run, stage=False)

    def wrap(self, fn, stage: bool):
        def timed(*a, **kw):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.depth -= 1
                if self.decoding:
                    if not stage:
                        self.sessions += dt
                    if self.depth == 0:  # outermost: a stage call, or a session run outside one
                        self.calls += dt

        return timed

    def start(self):  # the stream's first step is the prefill's token: the decode clock starts after it
        self.decoding = True


def time_rounds(args, exp, pair):
    pipes = {}
    for method in args.methods:
        torch_spec = RunSpec(method=method, budget=args.budget, arm=args.arm, dtype=exp.dtype)
        ort_spec = replace(torch_spec, backend="onnxruntime", export=exp.path, threads=args.threads or None)
        pipes[method] = {
            "torch": open_pipeline(torch_spec, Sources(pair=pair)),
            "onnxruntime": open_pipeline(ort_spec, Sources(export=exp)),
        }
    rows = []
    for method, by_backend in pipes.items():
        ids = [by_backend["torch"].tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[: args.prompts]]
        acc = {b: {"decode": 0.0, "calls": 0.0, "sessions": 0.0, "rounds": 0, "committed": 0} for b in by_backend}
        for pipe in by_backend.values():  # warm-up (and CaDDTree's cost curve)
            pipe.generate(ids[0], args.max_new_tokens, SamplingConfig())
        tokens = {}
        for i, prompt in enumerate(ids):
            for b in ("torch", "onnxruntime") if i % 2 else ("onnxruntime", "torch"):
                pipe = by_backend[b]
                clock = StageClock(pipe.backend)
                out = Generation()
                for step in pipe.stream(prompt, args.max_new_tokens, SamplingConfig()):
                    out.add(step)
                    clock.start()
                for name in STAGE_CALLS:  # unwrap
                    vars(pipe.backend).pop(name, None)
                if (runner := getattr(pipe.backend, "runner", None)) is not None:
                    vars(runner).pop("run", None)
                a = acc[b]
                a["decode"] += out.decode_s
                a["calls"] += clock.calls
                a["sessions"] += clock.sessions
                a["rounds"] += len(out.rounds)
                a["committed"] += sum(r.accepted for r in out.rounds)
                tokens.setdefault(b, []).append(out.tokens)
        same = tokens["torch"] == tokens["onnxruntime"]
        for b, a in acc.items():
            r = a["rounds"]
            rows.append(
                {
                    "backend": b,
                    "method": method,
                    "rounds": r,
                    "tau": a["committed"] / r,
                    "round_ms": a["decode"] / r * 1e3,
                    "stage_ms": a["calls"] / r * 1e3,
                    "session_ms": a["sessions"] / r * 1e3 if b == "onnxruntime" else None,
                    "python_share": 1 - a["calls"] / a["decode"],
                    "same_tokens": same,
                }
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="registry name (default: the export's source, or tiny)")
    ap.add_argument("--target", help="target checkpoint directory")
    ap.add_argument("--drafter", help="drafter checkpoint directory")
    ap.add_argument("--model-dir")
    ap.add_argument("--export", help="export directory (default: export the pair to a temporary directory)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads of both backends (0: their defaults)")
    ap.add_argument("--past", type=int, default=128, help="past length P of the stage inputs")
    ap.add_argument("--width", type=int, default=17, help="verify width N (budget + 1)")
    ap.add_argument("--prefill", type=int, default=64, help="prefill length")
    ap.add_argument("--context", type=int, default=4, help="context rows appended per round")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--methods", nargs="+", default=["ar", "ddtree", "dominotree"])
    ap.add_argument("--arm", default="marg", help="dominotree arm (marg needs no Domino scorer stages)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        if args.export:
            exp = load_export(args.export)
            pair, model = source_pair(args, exp)
        else:
            from dtrt.exporter.export_config import ExportConfig
            from dtrt.exporter.write import export_pair

            model = args.model or (None if args.target else "tiny")
            pair = load_pair(resolve_spec(**(sources(args) | {"model": model}), backend="torch"))
            exp = export_pair(pair, Path(tmp) / "export", ExportConfig(max_context=1024), model=model)
        stages = time_stages(args, *stage_cases(args, exp, pair))
        rounds = time_rounds(args, exp, pair)

    print(
        f"{model or pair.target}, {exp.manifest['dtype']}, {torch.get_num_threads()} torch threads, "
        f"onnxruntime threads {args.threads or 'default'}; stages: {args.repeats} calls after {args.warmup} "
        f"warm-up, medians\n"
    )
    print("| stage | shape | torch ms | onnxruntime ms | torch / onnxruntime | max abs diff |")
    print("|---|---|---:|---:|---:|---:|")
    for r in stages:
        print(
            f"| {r['stage']} | {r['shape']} | {r['torch_ms']:.3f} | {r['onnxruntime_ms']:.3f} | "
            f"{r['torch_over_onnxruntime']:.2f}x | {r['max_abs_diff']:.1e} |"
        )
    print(
        f"\nDecode rounds: {args.prompts} prompts x {args.max_new_tokens} tokens per backend and method, "
        f"budget {args.budget}\n"
    )
    print("| method | backend | rounds | tau | ms / round | in stage calls | in session.run | Python outside |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rounds:
        sess = f"{r['session_ms']:.2f}" if r["session_ms"] is not None else "-"
        print(
            f"| {r['method']} | {r['backend']} | {r['rounds']} | {r['tau']:.2f} | {r['round_ms']:.2f} | "
            f"{r['stage_ms']:.2f} | {sess} | {r['python_share']:.0%} |"
        )
    if not all(r["same_tokens"] for r in rounds):
        print(
            "\nwarning: the backends generated different tokens for",
            sorted({r["method"] for r in rounds if not r["same_tokens"]}),
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": vars(args), "torch_threads": torch.get_num_threads(), "stages": stages, "rounds": rounds},
                f,
                indent=2,
            )


if __name__ == "__main__":
    try:
        main()
    except DtrtError as e:
        raise SystemExit(f"error: {e}") from None

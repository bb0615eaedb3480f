"""A GPU loan, planned and run as a fixed sequence of calls (PLAN.md says which, in order).

    python scripts/gpu/loan.py stage                  # parts, plan (.gpu-loan/PLAN.md): here, before a loan
    python scripts/gpu/loan.py hold | release         # the inputs that travel inside the parts, moved aside/back
    python scripts/gpu/loan.py receive PART --into D  # on the GPU: one part arrived whole
    python scripts/gpu/loan.py train --parts D ...    # on the GPU: every part there, unpacked, checked, trained
    python scripts/gpu/loan.py preflight --out D      # the training call on the tiny pair, in seconds
    python scripts/gpu/loan.py returned --from D --into runs/gpu   # here: the returned checkpoint rebuilt
    python scripts/gpu/loan.py dry-run                # every call on the CPU, tiny pair and sizes, limits checked

Every refusal is one line and a non-zero exit."""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(REPO)]

import calls  # noqa: E402
import parts  # noqa: E402
import returned  # noqa: E402
import stage  # noqa: E402
import target_codec  # noqa: E402
from limits import LIMITS, MiB  # noqa: E402

LOAN = REPO / ".gpu-loan"


def cmd_stage(args):
    """The staged folder, its parts and the plan, for the shipped SmolLM2 drafter (or the tiny pair)."""
    from dtrt.bench.datasets import load
    from dtrt.zoo import registry

    folder = Path(args.out)
    if args.model == "tiny":
        pair = registry.tiny_pair()
        data = [Path(p) for p in args.data]
        spec = dict(
            target=pair.target,
            gguf=None,
            data=data,
            drafter=Path(args.init_from or pair.domino),
            corpus=[Path(p) for p in args.corpus],
            held_out=stage.TINY_HELD_OUT,
            settings=stage.TINY,
        )
    else:
        from dtrt.artifacts.files import cache_dir
        from dtrt.zoo import smollm2

        n = stage.SMOLLM2["config"]["eval_prompts"]
        spec = dict(
            target=smollm2.target_dir(cache_dir()),
            gguf=smollm2.gguf_path(),
            data=[REPO / "data" / "smollm2-v2"],
            drafter=Path(args.init_from or smollm2.ASSETS / "domino"),
            corpus=[Path(p) for p in args.corpus or [REPO / "data" / "drafter" / "corpus"]],
            held_out={name: [p.turns[0] for p in load(name, n, seed=0)] for name in ("mt-bench", "humaneval")},
            settings=stage.SMOLLM2,
        )
    for d in spec["data"]:
        if not d.is_dir():
            raise SystemExit(f"stage: {d}: not there (held aside? `python scripts/gpu/loan.py release` first)")
    t0 = time.perf_counter()
    built = stage.build(folder / "stage", **spec)
    staged_bytes = calls.path_bytes(folder / "stage")
    dirs = parts.split(folder / "stage", folder, part_bytes=args.part_mib * MiB)
    plan = calls.plan(REPO, dirs, budget_s=args.budget_s, measure_s=args.measure_s)
    summary = f"{staged_bytes / MiB:.1f} MiB in {len(dirs)} parts ({', '.join(map(str, built['data']))}, " + (
        f"{built['config']['corpus_chars']:,} corpus characters, held out: {', '.join(built['held_out'])})"
    )
    calls.write(plan, folder, staged={"summary": summary, "bytes": staged_bytes, "run": built})
    print(calls.markdown(plan, staged={"summary": summary}))
    print(f"staged in {time.perf_counter() - t0:.0f}s; the plan is {folder / 'PLAN.md'}")
    for problem in calls.problems(plan):
        print(f"stage: {problem}", file=sys.stderr)
    return 1 if calls.problems(plan) else 0


def _held_dir() -> Path:
    return LOAN / "held"


def _move(verb: str, src_root: Path, dst_root: Path):
    """Every held path from under `src_root` to under `dst_root`, refusing to overwrite one already there."""
    for rel in calls.HELD:
        src, dst = src_root / rel, dst_root / rel
        if src.exists():
            if dst.exists():
                raise SystemExit(f"{verb}: {dst} is already there; compare it with {src} and remove one")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dst)


def cmd_hold(args):
    _move("hold", REPO, _held_dir())
    print(f"held: {', '.join(calls.HELD)}; the tree that travels: {calls.tree_bytes(REPO) / MiB:.1f} MiB")


def cmd_release(args):
    _move("release", _held_dir(), REPO)
    print(f"released: {', '.join(calls.HELD)}")


def cmd_receive(args):
    manifest = parts.check(args.part)
    into = Path(args.into)
    into.mkdir(parents=True, exist_ok=True)
    for p in Path(args.part).iterdir():
        shutil.copy2(p, into / p.name)
    have = sorted(p.name for p in into.glob("*.bin"))
    print(f"received {args.part}: {len(have)} of {len(manifest['parts'])} parts there ({', '.join(have)})")


def cmd_train(args):
    import train_call

    work = Path(args.work)
    t0 = time.perf_counter()
    unpacked = parts.join([Path(args.parts)], work / "stage")
    stage.restore_target(unpacked, work / "target")
    print(f"unpacked and checked the parts, rebuilt the target in {time.perf_counter() - t0:.1f}s")
    device = args.device or ("cuda" if _cuda() else "cpu")
    report = train_call.run(
        unpacked,
        Path(args.out),
        work,
        budget_s=args.budget_s - (time.perf_counter() - t0),
        device=device,
        eval_every_s=args.eval_every_s,
        probe_batches=[int(b) for b in args.probe_batches.split(",")] if args.probe_batches else None,
        probe_rows=args.probe_rows,
        min_train_s=args.min_train_s,
    )
    best = report.get("best")
    print(f"train call: {report.get('steps_done')} steps, best held-out tau {best:.2f}" if best else "no evaluation")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_preflight(args):
    """The training call's whole path on the tiny pair, on this machine's GPU, in seconds: what the first call runs
    so that a broken package or kernel shows before the parts and the loan's minutes are spent on it."""
    import dry_run
    import train_call

    from dtrt.zoo import registry

    work = Path(tempfile.mkdtemp(prefix="dtrt-preflight-"))
    data, corpus, init = dry_run.tiny_inputs(work)
    spec = dict(data=[data], drafter=init, corpus=[corpus], held_out=stage.TINY_HELD_OUT, settings=stage.TINY)
    stage.build(work / "stage", target=registry.tiny_pair().target, gguf=None, **spec)
    stage.restore_target(work / "stage", work / "target")
    device = "cuda" if _cuda() else "cpu"
    report = train_call.run(
        work / "stage", Path(args.out), work, budget_s=args.budget_s, device=device, eval_every_s=5, log=lambda *a: None
    )
    print(
        f"preflight on {report['device']} (torch {report['torch']}): {report['steps_done']} steps, held-out tau "
        f"{report['probe']['tau_start']['dominotree']:.2f} -> {report['best']:.2f}, {report['elapsed_s']:.0f}s"
    )


def cmd_returned(args):
    record = returned.rebuild(Path(args.source), Path(args.into) / "domino")
    print(
        f"{args.into}/domino: step {record.get('step')}, held-out tau as the call measured it "
        f"{json.dumps(record.get('tau'))}"
    )


def cmd_dry_run(args):
    import dry_run

    return dry_run.main(REPO, keep=args.keep)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="stage the loan's inputs in parts and write the plan")
    s.add_argument("--model", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
    s.add_argument("--out", default=str(LOAN))
    s.add_argument("--init-from", help="the drafter the run starts from (default: the shipped one)")
    s.add_argument("--data", nargs="*", default=[], help="drafter-data folders (tiny only)")
    s.add_argument("--corpus", nargs="*", default=[])
    s.add_argument("--part-mib", type=int, default=LIMITS.part_bytes // MiB)
    s.add_argument("--budget-s", type=int, default=390, help="the training call's seconds")
    s.add_argument("--measure-s", type=int, default=210, help="the measurement call's seconds")
    s.set_defaults(fn=cmd_stage)
    sub.add_parser("hold").set_defaults(fn=cmd_hold)
    sub.add_parser("release").set_defaults(fn=cmd_release)
    r = sub.add_parser("receive", help="check one arrived part and keep it with the others")
    r.add_argument("part")
    r.add_argument("--into", required=True)
    r.set_defaults(fn=cmd_receive)
    t = sub.add_parser("train", help="join the parts, rebuild the target, train (the training call)")
    t.add_argument("--parts", required=True)
    t.add_argument("--work", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--budget-s", type=float, required=True)
    t.add_argument("--eval-every-s", type=float, default=60.0)
    t.add_argument("--device", choices=["cpu", "cuda"])
    t.add_argument("--probe-batches", help="comma list of batch sizes the probe times (default: the staged ones)")
    t.add_argument("--probe-rows", type=int, default=512, help="rows the probe featurizes and trains on")
    t.add_argument(
        "--min-train-s",
        type=float,
        default=0.0,
        help="train at least this long after the probe, past --budget-s if the probe ran slow (the CPU dry run: a "
        "busy machine's probe must not leave the call nothing to train)",
    )
    t.set_defaults(fn=cmd_train)
    f = sub.add_parser("preflight", help="the training call on the tiny pair, on this machine's GPU")
    f.add_argument("--out", required=True)
    f.add_argument("--budget-s", type=float, default=40.0)
    f.set_defaults(fn=cmd_preflight)
    b = sub.add_parser("returned", help="rebuild the checkpoint a training call brought back")
    b.add_argument("--from", dest="source", required=True)
    b.add_argument("--into", required=True)
    b.set_defaults(fn=cmd_returned)
    d = sub.add_parser("dry-run", help="every call on the CPU at tiny sizes")
    d.add_argument("--keep", help="keep the dry run's folders here")
    d.set_defaults(fn=cmd_dry_run)
    args = ap.parse_args(argv)
    try:
        return args.fn(args) or 0
    except (parts.PartsError, target_codec.CodecError) as e:
        print(f"loan: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a DtrtError's one line (the project's own refusals)
        if type(e).__name__ == "DtrtError":
            print(f"loan: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

"""An offline GPU job: drafter training (and, if asked, a measurement) packed for a GPU machine reached only by
calls that each carry and bring back a limited number of bytes and run a limited time, planned here as a fixed
sequence of calls (PLAN.md says which, in order). The machine's limits are the user's: a limits file and/or
`--limit KEY=VALUE` flags (docs/training.md has a limits file to copy).

    python scripts/gpu/job.py stage --limits L --data D   # here: parts and the plan (.gpu-job/PLAN.md)
    python scripts/gpu/job.py set-aside | put-back        # the inputs that travel inside the parts, moved out/back
    python scripts/gpu/job.py receive PART --into D       # on the GPU: one part arrived whole
    python scripts/gpu/job.py train --parts D ...         # on the GPU: every part there, unpacked, checked, trained
    python scripts/gpu/job.py unpack --parts D --work W   # on the GPU, a --measure-only job: unpacked, checked
    python scripts/gpu/job.py preflight --out D           # the training call on the tiny pair, in seconds
    python scripts/gpu/job.py returned --from D --into runs/gpu   # here: the returned checkpoint rebuilt
    python scripts/gpu/job.py dry-run --limits L          # every call on the CPU, tiny pair and sizes, limits checked

Every refusal is one line and a non-zero exit."""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(REPO)]

import calls  # noqa: E402
import limits  # noqa: E402
import parts  # noqa: E402
import returned  # noqa: E402
import stage  # noqa: E402
import target_codec  # noqa: E402
from limits import MiB  # noqa: E402

JOB = REPO / ".gpu-job"


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _travels_whole(folder: Path) -> bool:
    """Whether `folder` lies in the working tree and is not ignored by git (its parts would travel with every call)."""
    folder = Path(folder).resolve()
    if not folder.is_relative_to(REPO):
        return False
    # a file inside it: a folder not made yet still matches a folder pattern (`/.gpu-job/`)
    return subprocess.run(["git", "check-ignore", "-q", str(folder / "PLAN.md")], cwd=REPO).returncode != 0


def cmd_stage(args):
    """The staged folder, its parts and the plan, for the shipped SmolLM2 drafter (or the tiny pair)."""
    lim = limits.load(args.limits, args.limit)  # before the imports: a wrong limit is refused at once

    from dtrt.bench.datasets import load
    from dtrt.zoo import registry

    folder = Path(args.out)
    if _travels_whole(folder):
        raise SystemExit(
            f"stage: --out {folder}: in the working tree and not ignored by git, so every part would "
            "travel with every call; give an ignored folder (the default .gpu-job/ is one)"
        )
    if args.measure_only and (args.data or not args.measure_s):
        raise SystemExit("stage: --measure-only stages the pair for a measurement: give --measure-s, and no --data")
    if not args.measure_only and not args.data:
        raise SystemExit("stage: --data: the drafter-data folders to train on (or --measure-only, to measure alone)")
    data = [Path(p) for p in args.data]
    for d in data:
        if not d.is_dir():
            raise SystemExit(f"stage: --data {d}: not a folder (set aside? `python scripts/gpu/job.py put-back` first)")
    if args.model == "tiny":
        pair = registry.tiny_pair()
        spec = dict(
            target=pair.target,
            gguf=None,
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
            drafter=Path(args.init_from or smollm2.ASSETS / "domino"),
            corpus=[Path(p) for p in args.corpus or [REPO / "data" / "drafter" / "corpus"]],
            held_out={name: [p.turns[0] for p in load(name, n, seed=0)] for name in ("mt-bench", "humaneval")},
            settings=stage.SMOLLM2,
        )
    if args.measure_only:
        spec["corpus"] = []
    for p in spec["corpus"]:
        if not p.exists():
            raise SystemExit(
                f"stage: --corpus {p}: not there (python scripts/drafter_data.py --out data/drafter writes one)"
            )
    t0 = time.perf_counter()
    if args.measure_only:
        pair = {k: spec[k] for k in ("target", "gguf", "drafter", "held_out")}
        stage.build_pair(folder / "stage", **pair)
        built = {"data": [], "held_out": list(spec["held_out"])}
    else:
        built = stage.build(folder / "stage", data=data, **spec)
    staged_bytes = calls.path_bytes(folder / "stage")
    aside = calls.to_set_aside(REPO, [*data, spec["drafter"], *spec["corpus"]], args.set_aside)
    tree = calls.tree_bytes(REPO, without=aside)
    part_bytes = lim.part_bytes or lim.call_bytes - tree - MiB
    if part_bytes < parts.MANIFEST_ROOM * 2:
        raise SystemExit(
            f"stage: the working tree that travels is {tree / MiB:.1f} MiB, leaving no room for a part under "
            f"call_bytes ({lim.call_bytes / MiB:.1f} MiB); set more aside (--set-aside PATH) or give part_bytes"
        )
    dirs = parts.split(folder / "stage", folder, part_bytes=part_bytes)
    if args.measure_only:
        train_s, what = 0, "the pair alone"
    else:
        train_s = args.train_s if args.train_s is not None else calls.default_train_s(lim, len(dirs), args.measure_s)
        what = f"{', '.join(map(str, built['data']))}, {built['config']['corpus_chars']:,} corpus characters"
    summary = f"{staged_bytes / MiB:.1f} MiB in {len(dirs)} parts ({what}, held out: {', '.join(built['held_out'])})"
    plan = calls.plan(
        REPO, dirs, lim, tree_bytes=tree, train_s=train_s, measure_s=args.measure_s, measure_only=args.measure_only
    )
    checkpoint = 0 if args.measure_only else (spec["drafter"] / "model.safetensors").stat().st_size
    calls.write(
        plan,
        lim,
        folder,
        staged={"summary": summary, "bytes": staged_bytes, "run": built},
        set_aside=aside,
        shown=_shown(folder),
    )
    print((folder / "PLAN.md").read_text())
    print(f"staged in {time.perf_counter() - t0:.0f}s; the plan is {folder / 'PLAN.md'}")
    found = calls.problems(plan, lim, checkpoint_bytes=checkpoint)
    for problem in found:
        print(f"stage: {problem}", file=sys.stderr)
    return 1 if found else 0


def _move(verb: str, job: Path, *, back: bool):
    """Every path the plan sets aside from the working tree to `job`/set-aside (or back), refusing to overwrite."""
    moved = []
    for rel in calls.read_set_aside(job):
        src, dst = REPO / rel, job / "set-aside" / rel
        if back:
            src, dst = dst, src
        if src.exists():
            if dst.exists():
                raise SystemExit(f"{verb}: {dst} is already there; compare it with {src} and remove one")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dst)
            moved.append(rel)
    return moved


def cmd_set_aside(args):
    moved = _move("set-aside", Path(args.job), back=False)
    aside = calls.read_set_aside(Path(args.job))
    print(
        f"set aside: {', '.join(moved) or 'nothing'}; the tree that travels: "
        f"{calls.tree_bytes(REPO, without=aside) / MiB:.1f} MiB"
    )


def cmd_put_back(args):
    print(f"put back: {', '.join(_move('put-back', Path(args.job), back=True)) or 'nothing'}")


def cmd_receive(args):
    manifest = parts.check(args.part)
    into = Path(args.into).expanduser()
    into.mkdir(parents=True, exist_ok=True)
    for p in Path(args.part).iterdir():
        shutil.copy2(p, into / p.name)
    have = sorted(p.name for p in into.glob("*.bin"))
    print(f"received {args.part}: {len(have)} of {len(manifest['parts'])} parts there ({', '.join(have)})")


def _unpack(parts_dir: str, work: Path) -> Path:
    """Every part joined and checked into `work`/stage, the target rebuilt into `work`/target."""
    t0 = time.perf_counter()
    unpacked = parts.join([Path(parts_dir).expanduser()], work / "stage")
    stage.restore_target(unpacked, work / "target")
    print(f"unpacked and checked the parts, rebuilt the target in {time.perf_counter() - t0:.1f}s")
    return unpacked


def cmd_unpack(args):
    _unpack(args.parts, Path(args.work).expanduser())


def cmd_train(args):
    import train_call

    work = Path(args.work).expanduser()
    piece = limits.size(args.piece_bytes, f"--piece-bytes {args.piece_bytes}")
    t0 = time.perf_counter()
    unpacked = _unpack(args.parts, work)
    device = args.device or ("cuda" if _cuda() else "cpu")
    report = train_call.run(
        unpacked,
        Path(args.out),
        work,
        budget_s=args.budget_s - (time.perf_counter() - t0),
        device=device,
        piece_bytes=piece,
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
    """The training call's whole path on the tiny pair, on this machine's GPU, in seconds: what a first call runs
    so that a broken package or kernel shows before the parts and the job's minutes are spent on it."""
    import dry_run
    import train_call

    from dtrt.zoo import registry

    with tempfile.TemporaryDirectory(prefix="dtrt-preflight-") as tmp:  # gone when it returns
        work = Path(tmp)
        data, corpus, init = dry_run.tiny_inputs(work)
        spec = dict(data=[data], drafter=init, corpus=[corpus], held_out=stage.TINY_HELD_OUT, settings=stage.TINY)
        stage.build(work / "stage", target=registry.tiny_pair().target, gguf=None, **spec)
        stage.restore_target(work / "stage", work / "target")
        device = "cuda" if _cuda() else "cpu"
        piece = limits.size(args.piece_bytes, f"--piece-bytes {args.piece_bytes}") if args.piece_bytes else None
        report = train_call.run(
            work / "stage",
            Path(args.out),
            work,
            budget_s=args.budget_s,
            device=device,
            piece_bytes=piece,
            eval_every_s=5,
            min_train_s=5,  # a busy machine's probe still leaves ten steps: the point is the path, not the time
            log=lambda *a: None,
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

    return dry_run.main(
        REPO,
        limits.load(args.limits, args.limit),
        keep=args.keep,
        set_aside=args.set_aside,
        train_s=args.train_s,
        measure_s=args.measure_s,
        measure_only=args.measure_only,
    )


def _limit_flags(p):
    p.add_argument("--limits", metavar="FILE", help="the GPU machine's limits, TOML or JSON (docs/training.md)")
    p.add_argument(
        "--limit", action="append", default=[], metavar="KEY=VALUE", help="one limit, over the file's (repeatable)"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="stage the job's inputs in parts and write the plan")
    _limit_flags(s)
    s.add_argument("--data", nargs="+", default=[], help="the drafter-data folders to train on (dtrt drafter-data)")
    s.add_argument(
        "--measure-only",
        action="store_true",
        help="no training: stage the pair alone (target, drafter, held-out prompts) for the measurement call",
    )
    s.add_argument("--model", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
    s.add_argument("--out", default=str(JOB), help="the job's folder (default .gpu-job/, ignored by git)")
    s.add_argument("--init-from", help="the drafter the run starts from (default: the shipped one)")
    s.add_argument("--corpus", nargs="*", default=[], help="corpus text (default data/drafter/corpus; tiny: none)")
    s.add_argument(
        "--set-aside",
        nargs="*",
        default=[],
        metavar="PATH",
        help="more working-tree paths that need not travel with each call (the staged inputs always are)",
    )
    s.add_argument("--train-s", type=int, help="the training call's seconds (default: what the limits leave)")
    s.add_argument("--measure-s", type=int, default=0, help="a measurement call of this many seconds (default none)")
    s.set_defaults(fn=cmd_stage)
    for name, fn in (("set-aside", cmd_set_aside), ("put-back", cmd_put_back)):
        p = sub.add_parser(name, help="move the paths the plan names out of the working tree, or back")
        p.add_argument("--job", default=str(JOB), help="the staged job's folder")
        p.set_defaults(fn=fn)
    r = sub.add_parser("receive", help="check one arrived part and keep it with the others")
    r.add_argument("part")
    r.add_argument("--into", required=True)
    r.set_defaults(fn=cmd_receive)
    u = sub.add_parser("unpack", help="join the parts, rebuild the target (a measure-only job's last part)")
    u.add_argument("--parts", required=True)
    u.add_argument("--work", required=True)
    u.set_defaults(fn=cmd_unpack)
    t = sub.add_parser("train", help="join the parts, rebuild the target, train (the training call)")
    t.add_argument("--parts", required=True)
    t.add_argument("--work", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--budget-s", type=float, required=True)
    t.add_argument("--piece-bytes", required=True, help="the largest file the call may bring back (e.g. 16MiB)")
    t.add_argument("--eval-every-s", type=float, default=60.0)
    t.add_argument("--device", choices=["cpu", "cuda"])
    t.add_argument("--probe-batches", help="comma list of batch sizes the probe times (default: the staged ones)")
    t.add_argument("--probe-rows", type=int, default=512, help="rows the probe featurizes and trains on")
    t.add_argument(
        "--min-train-s",
        type=float,
        default=0.0,
        help="train at least this long (and ten steps) after the probe, past --budget-s if the probe ran slow (the "
        "CPU dry run: a busy machine's probe must not leave the call nothing to train)",
    )
    t.set_defaults(fn=cmd_train)
    f = sub.add_parser("preflight", help="the training call on the tiny pair, on this machine's GPU")
    f.add_argument("--out", required=True)
    f.add_argument("--budget-s", type=float, default=40.0)
    f.add_argument("--piece-bytes", help="the largest file the call may bring back (default: no limit)")
    f.set_defaults(fn=cmd_preflight)
    b = sub.add_parser("returned", help="rebuild the checkpoint a training call brought back")
    b.add_argument("--from", dest="source", required=True)
    b.add_argument("--into", required=True)
    b.set_defaults(fn=cmd_returned)
    d = sub.add_parser("dry-run", help="every call on the CPU at tiny sizes, under the limits given")
    _limit_flags(d)
    d.add_argument("--keep", help="keep the dry run's folders here")
    d.add_argument(
        "--set-aside", nargs="*", default=[], metavar="PATH", help="working-tree paths counted as set aside, as a job's"
    )
    d.add_argument("--train-s", type=int, default=45, help="the training call's seconds")
    d.add_argument("--measure-s", type=int, default=60, help="the measurement call's seconds")
    d.add_argument("--measure-only", action="store_true", help="the plan of a measure-only job (stage --measure-only)")
    d.set_defaults(fn=cmd_dry_run)
    args = ap.parse_args(argv)
    try:
        return args.fn(args) or 0
    except (parts.PartsError, target_codec.CodecError, limits.LimitsError) as e:
        print(f"job: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a DtrtError's one line (the project's own refusals)
        if type(e).__name__ == "DtrtError":
            print(f"job: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

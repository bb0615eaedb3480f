"""Every call of the plan on the CPU, on the tiny pair at tiny sizes, each in its own process with the packages
the GPU machine lacks (`missing_packages`) hidden: staging in parts, each part received, the training call (probe,
in-memory features, evaluations, the checkpoint brought back in pieces; a measure-only job: the pair unpacked), the
measurement call; and every limit given checked on what the calls carry and bring back."""

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import calls
from limits import Limits, MiB

# the packages the GPU machine lacks, and dtrt's own install (there, dtrt is the checkout on the path, not a package)
HIDE = (
    "import sys\n"
    "for m in {missing!r}:\n"
    "    sys.modules[m] = None\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
)


def tiny_inputs(work: Path) -> tuple[Path, Path, Path]:
    """A drafter-data folder, a corpus file and a drafter trained for a few steps (the one the run starts from),
    for the tiny target."""
    from dtrt.train.config import DataGenConfig, TrainConfig
    from dtrt.train.datagen import drafter_data
    from dtrt.train.trainer import train_drafter
    from dtrt.zoo import registry
    from dtrt.zoo import tiny as tiny_mod

    pair = registry.tiny_pair()
    prompts = ["The cat sees ", "A quick fox ", "Every king walks ", "The dog ", "A small bird ", "The sun "]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (work / "corpus.txt").write_text(tiny_mod.corpus(20000, 7))
    cfg = DataGenConfig(samples=2, max_new_tokens=40, batch=6, shard_rows=4, corpus_row_tokens=64)
    drafter_data(pair.target, work / "data-tiny", cfg, prompts_file=work / "prompts.jsonl", log=lambda *a: None)
    small = dict(seq_len=64, block_size=6, gru_dim=16, emb_dim=16, corpus_rows=24, candidates=48)
    first = TrainConfig(**small, steps=2, eval_every=2, eval_prompts=2, eval_tokens=8)
    train_drafter(pair.target, work / "init", first, corpus=[work / "corpus.txt"], log=lambda *a: None)
    return work / "data-tiny", work / "corpus.txt", work / "init" / "domino"


def returned_problems(out: Path, limits: Limits) -> list[str]:
    files = [p for p in out.rglob("*") if p.is_file()]
    found = []
    if len(files) > limits.return_files:
        found.append(f"{out}: {len(files)} files come back, over return_files ({limits.return_files})")
    for p in files:
        if p.stat().st_size > limits.return_file_bytes:
            found.append(f"{p}: {p.stat().st_size / MiB:.1f} MiB, over return_file_bytes")
        if limits.return_depth is not None and len(p.relative_to(out).parts) - 1 > limits.return_depth:
            found.append(f"{p}: more than {limits.return_depth} folders down (return_depth)")
    if sum(p.stat().st_size for p in files) > limits.return_bytes:
        found.append(f"{out}: over return_bytes ({limits.return_bytes / MiB:.1f} MiB) in all")
    return found


def grown_s(out: Path) -> float:
    """Seconds the training call ran past its budget by `--min-train-s` (only the dry run passes it: a busy CPU's
    probe must not leave it nothing to train)."""
    report = out / "train.json"
    return json.loads(report.read_text()).get("budget_grown_s", 0.0) if report.is_file() else 0.0


def main(
    repo: Path,
    limits: Limits,
    *,
    keep: str | None = None,
    set_aside: list[str] = (),
    train_s: int = 45,
    measure_s: int = 60,
    measure_only: bool = False,
) -> int:
    """The plan staged and run under `limits`, its scratch folder and the returned files kept in `keep` (or a
    temporary folder); the working tree that travels counted without `set_aside`, as a job would set them aside."""
    work = Path(keep or tempfile.mkdtemp(prefix="dtrt-job-dry-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    limits = replace(limits, scratch_dir=str(work / "remote"))
    data, corpus, init = tiny_inputs(work)
    hide = work / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(HIDE.format(missing=limits.missing_packages))
    env = {
        **os.environ,
        "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the commands' python3 is this one
    }
    job = [sys.executable, str(repo / "scripts" / "gpu" / "job.py")]
    given = [f"--limit={k}={v}" for k, v in asdict(limits).items() if v is not None and k != "missing_packages"]
    staged = subprocess.run(
        [
            *job,
            "stage",
            *given,
            "--model",
            "tiny",
            "--out",
            str(work / "job"),
            *(["--measure-only"] if measure_only else ["--data", str(data), "--corpus", str(corpus)]),
            "--init-from",
            str(init),
            *([] if measure_only else ["--train-s", str(train_s)]),
            "--measure-s",
            str(measure_s),
            *(["--set-aside", *set_aside] if set_aside else []),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if staged.returncode:
        print(staged.stdout + staged.stderr)
        return 1
    dirs = sorted((work / "job").glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
    plan = calls.plan(
        repo,
        dirs,
        limits,
        tree_bytes=calls.tree_bytes(repo, without=set_aside),
        train_s=0 if measure_only else train_s,
        measure_s=measure_s,
        measure_only=measure_only,
        gpu="echo 'no GPU: dry run'",
        train_args=" --device cpu --eval-every-s 10 --min-train-s 10",  # a busy CPU's probe must not eat it all
        measure_args=" --dry-run",
    )
    print(f"the tiny pair in {len(dirs)} parts; calls: {', '.join(c.name for c in plan)}")
    problems = calls.problems(plan, limits)
    for c in plan:
        out = work / "out" / c.name
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        done = subprocess.run(
            ["bash", "-c", c.command],
            cwd=repo,
            env={**env, "OUT": str(out)},
            capture_output=True,
            text=True,
            timeout=c.timeout_s + 180,
        )
        took = time.perf_counter() - t0
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        print(f"== {c.name}: exit {done.returncode} in {took:.1f}s (timeout {c.timeout_s}s)\n" + "\n".join(tail))
        if done.returncode:
            problems.append(f"{c.name} exited {done.returncode}: {' / '.join(tail)}")
        if took > c.timeout_s + grown_s(out):
            problems.append(f"{c.name} took {took:.0f}s, over its timeout {c.timeout_s}s")
        problems += returned_problems(out, limits)
    if not measure_only:
        rebuilt = subprocess.run(
            [*job, "returned", "--from", str(work / "out" / "train"), "--into", str(work / "back")],
            capture_output=True,
            text=True,
            env=env,
        )
        print(rebuilt.stdout.strip() or rebuilt.stderr.strip())
        if rebuilt.returncode:
            problems.append(f"the returned checkpoint: {rebuilt.stderr.strip()}")
    for p in problems:
        print(f"dry run: {p}", file=sys.stderr)
    print(f"dry run: {'fits' if not problems else 'does not fit'}; its folders: {work}")
    return 1 if problems else 0

"""Every call of the plan on the CPU, on the tiny pair at tiny sizes, each in its own process with the packages
the GPU machine lacks hidden: staging in parts, each part received, the training call (probe, in-memory features,
evaluations, the checkpoint brought back in pieces), the measurement call; and every limit checked on what the
calls carry and bring back."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import calls
from limits import LIMITS, MISSING, MiB

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
    from dtrt.train.datagen import DataGenConfig, drafter_data
    from dtrt.train.trainer import TrainConfig, train_drafter
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


def returned_problems(out: Path) -> list[str]:
    files = [p for p in out.rglob("*") if p.is_file()]
    found = []
    if len(files) > LIMITS.return_files:
        found.append(f"{out}: {len(files)} files come back, over {LIMITS.return_files}")
    for p in files:
        if p.stat().st_size > LIMITS.return_file_bytes:
            found.append(f"{p}: {p.stat().st_size / MiB:.1f} MiB, over {LIMITS.return_file_bytes / MiB:.0f}")
        if len(p.relative_to(out).parts) > 3:
            found.append(f"{p}: more than two folders down")
    if sum(p.stat().st_size for p in files) > LIMITS.return_bytes:
        found.append(f"{out}: over {LIMITS.return_bytes / MiB:.0f} MiB in all")
    return found


def main(repo: Path, *, keep: str | None = None, train_s: int = 45, measure_s: int = 60) -> int:
    work = Path(keep or tempfile.mkdtemp(prefix="dtrt-loan-dry-"))
    work.mkdir(parents=True, exist_ok=True)
    data, corpus, init = tiny_inputs(work)
    hide = work / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(HIDE.format(missing=MISSING))
    env = {
        **os.environ,
        "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the commands' python3 is this one
    }
    loan = [sys.executable, str(repo / "scripts" / "gpu" / "loan.py")]
    staged = subprocess.run(
        [
            *loan,
            "stage",
            "--model",
            "tiny",
            "--out",
            str(work / "loan"),
            "--data",
            str(data),
            "--corpus",
            str(corpus),
            "--init-from",
            str(init),
            "--part-mib",
            "1",
            "--budget-s",
            str(train_s),
            "--measure-s",
            str(measure_s),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if staged.returncode:
        print(staged.stdout + staged.stderr)
        return 1
    dirs = sorted((work / "loan").glob("part-*"), key=lambda p: int(p.name.split("-")[1]))
    plan = calls.plan(
        repo,
        dirs,
        budget_s=train_s,
        measure_s=measure_s,
        remote=str(work / "remote"),
        gpu="echo 'no GPU: dry run'",
        train_args=" --device cpu --eval-every-s 10 --min-train-s 10",  # a busy CPU's probe must not eat it all
        measure_args=" --dry-run",
    )
    print(calls.markdown(plan, staged={"summary": f"the tiny pair in {len(dirs)} parts"}))
    problems = calls.problems(plan)
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
            timeout=c.timeout_s + 60,
        )
        took = time.perf_counter() - t0
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        print(f"== {c.name}: exit {done.returncode} in {took:.1f}s (timeout {c.timeout_s}s)\n" + "\n".join(tail))
        if done.returncode:
            problems.append(f"{c.name} exited {done.returncode}: {' / '.join(tail)}")
        if took > c.timeout_s:
            problems.append(f"{c.name} took {took:.0f}s, over its timeout {c.timeout_s}s")
        problems += returned_problems(out)
    rebuilt = subprocess.run(
        [*loan, "returned", "--from", str(work / "out" / "train"), "--into", str(work / "back")],
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

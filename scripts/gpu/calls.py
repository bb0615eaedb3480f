"""The loan as a fixed sequence of calls: each call's command, the paths it carries, its time limit and the time
it is expected to take; what each carries (the working tree that travels, plus its part) against the limit; and
the whole written out as PLAN.md, to be followed call by call by whoever holds the GPU."""

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from limits import LIMITS, MiB

# tracked paths that must not travel with every call, moved aside (`loan.py hold`) for the loan: the inputs travel
# once, inside the parts; the bench records (several MB, growing with every record) are not needed there at all
HELD = ("data/smollm2-v2", "dtrt/assets/smollm2-135m/domino", "bench-results")
REMOTE = "/tmp/dtrt-loan"  # on the GPU machine: parts as they arrive, the unpacked stage, the run


@dataclass
class Call:
    name: str
    command: str
    carry: list[str]
    timeout_s: int
    expected_s: int
    carried_bytes: int = 0


def tree_bytes(repo: Path, *, without=HELD) -> int:
    """Bytes of the working tree that travel with a call (tracked and untracked-not-ignored files that are there),
    leaving out the held paths."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in filter(None, out.decode().split("\0")):
        if any(name == h or name.startswith(h + "/") for h in without):
            continue
        path = repo / name
        if path.is_file():
            total += path.stat().st_size
    return total


def path_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _carry(path: Path, repo: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(repo.resolve())) if path.is_relative_to(repo.resolve()) else str(path)


def plan(
    repo: Path,
    parts: list[Path],
    *,
    budget_s: int = 390,
    measure_s: int = 210,
    remote: str = REMOTE,
    gpu: str = "nvidia-smi -L",
    train_args: str = "",
    measure_args: str = "",
) -> list[Call]:
    """The calls for these staged parts (folders under `repo`): one per part, the last one training. The dry run
    gives its own `remote` folder, `gpu` check and extra arguments."""
    repo = Path(repo)
    loan = "python3 scripts/gpu/loan.py"
    rel = [_carry(p, repo) for p in parts]
    calls = []
    for i, part in enumerate(rel[:-1], 1):
        calls.append(
            Call(
                f"stage-{i}",
                f"{loan} receive {part} --into {remote}/parts && {gpu}",
                [part],
                timeout_s=90,
                expected_s=25,
            )
        )
    calls.append(
        Call(
            "train",
            f"set -o pipefail; {loan} receive {rel[-1]} --into {remote}/parts && "
            f"PYTHONUNBUFFERED=1 {loan} train --parts "
            f"{remote}/parts --work {remote} --out $OUT --budget-s {budget_s}{train_args} 2>&1 | tee $OUT/train.log",
            [rel[-1]],
            timeout_s=budget_s + 45,
            expected_s=budget_s + 15,
        )
    )
    calls.append(
        Call(
            "measure",
            f"PYTHONUNBUFFERED=1 bash scripts/gpu/measure.sh $OUT {measure_s - 20}{measure_args}",
            [],
            timeout_s=measure_s + 30,
            expected_s=measure_s,
        )
    )
    tree = tree_bytes(repo)
    for c in calls:
        c.carried_bytes = tree + sum(path_bytes(repo / p) for p in c.carry)  # an absolute p stays itself
    return calls


def problems(calls: list[Call]) -> list[str]:
    """Every limit the plan breaks, in words; empty when it fits."""
    out = []
    for c in calls:
        if c.carried_bytes > LIMITS.call_bytes:
            out.append(f"{c.name} carries {c.carried_bytes / MiB:.1f} MiB, over {LIMITS.call_bytes / MiB:.0f}")
        if c.timeout_s > LIMITS.call_s:
            out.append(f"{c.name} may run {c.timeout_s}s, over {LIMITS.call_s}")
        if len(c.command) > 2000:
            out.append(f"{c.name}'s command is {len(c.command)} characters, over 2000")
    if (total := expected_s(calls)) > LIMITS.plan_s:
        out.append(f"the plan is expected to take {total}s, over {LIMITS.plan_s}")
    return out


def expected_s(calls: list[Call]) -> int:
    return LIMITS.start_s + sum(c.expected_s for c in calls) + LIMITS.gap_s * len(calls)


def markdown(calls: list[Call], *, staged: dict) -> str:
    rows = "\n".join(
        f"| {i} | {c.name} | `{c.command}` | {', '.join(c.carry) or '-'} | {c.carried_bytes / MiB:.1f} | "
        f"{c.timeout_s} | {c.expected_s / 60:.1f} |"
        for i, c in enumerate(calls, 1)
    )
    held = " and ".join(HELD)
    return f"""# The GPU loan, call by call

Staged: {staged["summary"]}. Expected: {expected_s(calls) / 60:.1f} minutes of GPU time, the machine's start
({LIMITS.start_s}s) and {LIMITS.gap_s}s between calls included; the loan gives {LIMITS.loan_s / 60:.0f}.

1. Before the first call: `python scripts/gpu/loan.py hold` (moves {held} aside, so that they do not travel with
   every call: the inputs travel once, inside the parts; `python scripts/gpu/loan.py release` puts them back).
2. Make the calls below in order, each as soon as the one before returns: the machine is given back after
   {LIMITS.idle_s}s idle, and with it the parts already sent. Run each command from the repository root, with the
   paths it carries; `$OUT` is the folder whose files come back.
3. After the training call: `python scripts/gpu/loan.py returned --from <its returned files> --into runs/gpu`
   rebuilds the checkpoint (refused if a piece is missing or corrupted); re-measure its held-out tau on the CPU as
   the shipped drafter's was measured, and ship it only if it is better there.
4. After the measurement call: unpack its `measure.tgz`; the summary is at the end of `measure.log`.
5. Give the machine back after the last call; then `python scripts/gpu/loan.py release`.

A second loan continues from the returned checkpoint: stage again with `--init-from runs/gpu/domino`.

| # | call | command | carries | MiB carried | timeout s | expected min |
|---|---|---|---|---|---|---|
{rows}
"""


def write(calls: list[Call], folder: Path, *, staged: dict):
    folder = Path(folder)
    (folder / "PLAN.md").write_text(markdown(calls, staged=staged))
    (folder / "plan.json").write_text(json.dumps({"staged": staged, "calls": [asdict(c) for c in calls]}, indent=1))

"""The job as a fixed sequence of calls: each call's command, the paths it carries, its time limit and the time it
is expected to take; what each carries (the working tree that travels, plus its part) and brings back against the
user's limits; and the whole written out as PLAN.md, to be followed call by call."""

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from limits import Limits, MiB

RECEIVE_S, RECEIVE_TIMEOUT_S = 25, 90  # a part's call: its copy into the scratch folder and the GPU's listing
TRAIN_OVERHEAD_S, TRAIN_TIMEOUT_S = 15, 45  # the training call past its budget: start-up expected, and allowed
MEASURE_TIMEOUT_S = 30
UNPACK_S, UNPACK_TIMEOUT_S = 20, 90  # a measure-only job's last call: the parts joined, the target rebuilt
RETURNED_RECORDS = (
    3  # besides the checkpoint's pieces, the training call brings back drafter.json, train.json, train.log
)


@dataclass
class Call:
    name: str
    command: str
    carry: list[str]
    timeout_s: int
    expected_s: int
    carried_bytes: int = 0


def travelling(repo: Path) -> list[str]:
    """The files of the working tree that travel with a call: tracked, and untracked but not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    return [n for n in out.decode().split("\0") if n and (Path(repo) / n).is_file()]


def _under(name: str, paths) -> bool:
    return any(name == p or name.startswith(p.rstrip("/") + "/") for p in paths)


def tree_bytes(repo: Path, *, without=()) -> int:
    """Bytes of the working tree that travel with a call, leaving out the paths set aside."""
    return sum((Path(repo) / n).stat().st_size for n in travelling(repo) if not _under(n, without))


def to_set_aside(repo: Path, inputs: list[Path], extra: list[str]) -> list[str]:
    """The paths moved out of the working tree for the job (`job.py set-aside`): the staged inputs that would travel
    with every call besides inside the parts, and whatever else the user names."""
    repo = Path(repo).resolve()
    names = travelling(repo)
    found = []
    for p in inputs:
        p = Path(p).resolve()
        rel = str(p.relative_to(repo)) if p.is_relative_to(repo) else None
        if rel and any(_under(n, [rel]) for n in names):
            found.append(rel)
    for rel in extra:
        if not (repo / rel).exists():
            raise SystemExit(f"stage: --set-aside {rel}: not there in {repo}")
        found.append(str((repo / rel).resolve().relative_to(repo)))
    return sorted(set(found))


def path_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _carry(path: Path, repo: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(repo.resolve())) if path.is_relative_to(repo.resolve()) else str(path)


def default_train_s(limits: Limits, parts: int, measure_s: int) -> int:
    """The training call's budget that fills what the limits leave: the whole job less the start, the parts' calls,
    the measurement and the gaps, within one call's limit."""
    calls = parts + (1 if measure_s else 0)
    left = limits.total_s - limits.start_s - limits.gap_s * calls - RECEIVE_S * (parts - 1) - measure_s
    return max(0, min(left - TRAIN_OVERHEAD_S, limits.call_s - TRAIN_TIMEOUT_S))


def plan(
    repo: Path,
    parts: list[Path],
    limits: Limits,
    *,
    tree_bytes: int,
    train_s: int,
    measure_s: int = 0,
    gpu: str = "nvidia-smi -L",
    train_args: str = "",
    measure_args: str = "",
    measure_only: bool = False,
) -> list[Call]:
    """The calls for these staged parts: one per part, the last one training (`measure_only`: unpacking the pair),
    then the measurement if `measure_s`.
    The dry run gives its own `gpu` check and extra arguments."""
    repo = Path(repo)
    job = "python3 scripts/gpu/job.py"
    remote = limits.scratch_dir
    rel = [_carry(p, repo) for p in parts]
    calls = []
    for i, part in enumerate(rel[:-1], 1):
        calls.append(
            Call(
                f"stage-{i}",
                f"{job} receive {part} --into {remote}/parts && {gpu}",
                [part],
                timeout_s=min(RECEIVE_TIMEOUT_S, limits.call_s),
                expected_s=RECEIVE_S,
            )
        )
    if measure_only:  # the last part received, the pair unpacked for the measurement
        calls.append(
            Call(
                "unpack",
                f"{job} receive {rel[-1]} --into {remote}/parts && {job} unpack --parts {remote}/parts --work {remote}",
                [rel[-1]],
                timeout_s=min(RECEIVE_TIMEOUT_S + UNPACK_TIMEOUT_S, limits.call_s),
                expected_s=RECEIVE_S + UNPACK_S,
            )
        )
    else:
        calls.append(
            Call(
                "train",
                f"set -o pipefail; {job} receive {rel[-1]} --into {remote}/parts && "
                f"PYTHONUNBUFFERED=1 {job} train --parts {remote}/parts --work {remote} --out $OUT "
                f"--budget-s {train_s} --piece-bytes {limits.return_file_bytes}{train_args} 2>&1 | tee $OUT/train.log",
                [rel[-1]],
                timeout_s=train_s + TRAIN_TIMEOUT_S,
                expected_s=train_s + TRAIN_OVERHEAD_S,
            )
        )
    if measure_s:
        calls.append(
            Call(
                "measure",
                f"PYTHONUNBUFFERED=1 MEASURE_PAIR={remote} bash scripts/gpu/measure.sh $OUT {max(1, measure_s - 20)}"
                f"{measure_args}",
                [],
                timeout_s=measure_s + MEASURE_TIMEOUT_S,
                expected_s=measure_s,
            )
        )
    for c in calls:
        c.carried_bytes = tree_bytes + sum(path_bytes(repo / p) for p in c.carry)  # an absolute p stays itself
    return calls


def problems(calls: list[Call], limits: Limits, *, checkpoint_bytes: int = 0) -> list[str]:
    """Every limit the plan breaks, in words; empty when it fits."""
    out = []
    for c in calls:
        if c.carried_bytes > limits.call_bytes:
            out.append(
                f"{c.name} carries {c.carried_bytes / MiB:.1f} MiB, over call_bytes ({limits.call_bytes / MiB:.1f})"
            )
        if c.timeout_s > limits.call_s:
            out.append(f"{c.name} may run {c.timeout_s}s, over call_s ({limits.call_s})")
        if limits.command_chars and len(c.command) > limits.command_chars:
            out.append(
                f"{c.name}'s command is {len(c.command)} characters, over command_chars ({limits.command_chars})"
            )
    if checkpoint_bytes:
        files = -(-checkpoint_bytes // limits.return_file_bytes) + RETURNED_RECORDS
        if files > limits.return_files:
            out.append(f"the checkpoint comes back as {files} files, over return_files ({limits.return_files})")
        if checkpoint_bytes > limits.return_bytes:
            out.append(f"the checkpoint is {checkpoint_bytes / MiB:.1f} MiB, over return_bytes")
    if limits.gap_s >= limits.idle_s:
        out.append(f"gap_s ({limits.gap_s}) is not under idle_s ({limits.idle_s}): the machine goes back between calls")
    if (total := expected_s(calls, limits)) > limits.total_s:
        out.append(f"the plan is expected to take {total}s, over total_s ({limits.total_s})")
    return out


def expected_s(calls: list[Call], limits: Limits) -> int:
    return limits.start_s + sum(c.expected_s for c in calls) + limits.gap_s * len(calls)


def markdown(calls: list[Call], limits: Limits, *, staged: dict, set_aside: list[str], job_dir: str) -> str:
    rows = "\n".join(
        f"| {i} | {c.name} | `{c.command}` | {', '.join(c.carry) or '-'} | {c.carried_bytes / MiB:.1f} | "
        f"{c.timeout_s} | {c.expected_s / 60:.1f} |"
        for i, c in enumerate(calls, 1)
    )
    aside = " and ".join(set_aside) or "nothing"
    names = {c.name for c in calls}
    if "train" in names:
        step3 = (
            "After the training call: `python scripts/gpu/job.py returned --from <its returned files> --into "
            "runs/gpu`\n   rebuilds the checkpoint (refused if a piece is missing or corrupted); measure its held-out "
            "tau again where the\n   drafter it started from was measured, and keep it only if it is better there."
        )
        later = (
            "\nA later job continues from the returned checkpoint: stage again with `--init-from runs/gpu/domino`.\n"
        )
    else:
        step3 = "No training call (a measure-only job): the last part's call unpacks the pair for the measurement."
        later = ""
    if "measure" in names:
        step4 = "After the measurement call: unpack its `measure.tgz`; the summary is at the end of `measure.log`."
    else:
        step4 = "No measurement call: stage with `--measure-s SECONDS` for one."
    return f"""# The offline GPU job, call by call

Staged: {staged["summary"]}. Expected: {expected_s(calls, limits) / 60:.1f} minutes of GPU time, the machine's start
({limits.start_s}s) and {limits.gap_s}s between calls included, of the {limits.total_s / 60:.1f} the limits give.

1. Before the first call: `python scripts/gpu/job.py set-aside --job {job_dir}` (moves {aside} out of the working
   tree, so that they do not travel with every call: the inputs travel once, inside the parts;
   `python scripts/gpu/job.py put-back --job {job_dir}` returns them).
2. Make the calls below in order, each as soon as the one before returns: the machine goes back after
   {limits.idle_s}s idle, and with it the parts already sent. Run each command from the repository root, with the
   paths it carries; `$OUT` is the folder whose files come back.
3. {step3}
4. {step4}
5. After the last call: `python scripts/gpu/job.py put-back --job {job_dir}`.
{later}
| # | call | command | carries | MiB carried | timeout s | expected min |
|---|---|---|---|---|---|---|
{rows}
"""


def write(calls: list[Call], limits: Limits, folder: Path, *, staged: dict, set_aside: list[str], shown: str):
    folder = Path(folder)
    (folder / "PLAN.md").write_text(markdown(calls, limits, staged=staged, set_aside=set_aside, job_dir=shown))
    record = {"staged": staged, "set_aside": set_aside, "limits": asdict(limits), "calls": [asdict(c) for c in calls]}
    (folder / "plan.json").write_text(json.dumps(record, indent=1) + "\n")


def read_set_aside(folder: Path) -> list[str]:
    plan_file = Path(folder) / "plan.json"
    if not plan_file.is_file():
        raise SystemExit(f"{plan_file}: not there; stage the job first (python scripts/gpu/job.py stage)")
    return json.loads(plan_file.read_text())["set_aside"]

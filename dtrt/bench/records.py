"""A bench run's directory while it runs: run.json (the grid, written first) and records.jsonl (every finished
record appended at once), from which bench.json, bench.md and bench.png are derived. `dtrt bench --resume OUT`
reads both, refuses a different grid, and redoes nothing that is recorded."""

import json
import os
from pathlib import Path

from dtrt.errors import DtrtError

RUN, RECORDS = "run.json", "records.jsonl"


class RecordLog:
    def __init__(self, out: Path):
        self.path = Path(out) / RECORDS

    def load(self) -> list[dict]:
        """The records of an earlier run (a last line cut short by a kill is dropped)."""
        if not self.path.is_file():
            return []
        lines = self.path.read_text().splitlines()
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines) - 1:
                    raise DtrtError(f"{self.path}:{i + 1}: not a JSON record; the file was edited") from None
        return out

    def append(self, record: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def check_new(out: Path):
    """A new run must not write into the --out of another run's records."""
    if (Path(out) / RECORDS).is_file():
        raise DtrtError(
            f"--out {out}: holds the records of an earlier run; continue it with `dtrt bench --resume {out}` or "
            "pick another --out"
        )


def start(out: Path, grid: dict, resume: bool) -> list[dict]:
    """Write run.json ({"options", "grid"}) for a new run, or check its grid against `grid`'s on --resume: the
    records already done."""
    out = Path(out)
    run = out / RUN
    if not resume:
        check_new(out)
        out.mkdir(parents=True, exist_ok=True)
        run.write_text(json.dumps(grid, indent=1))
        return []
    if not run.is_file():
        raise DtrtError(f"--resume {out}: no {RUN} there, so it is not a bench run to continue")
    stored = json.loads(run.read_text()).get("grid", {})
    grid = grid.get("grid", {})
    # the flags first, then what they decide (the prompt subset follows the seed)
    order = ("quant", "rows", "sources", "temperatures", "max_new_tokens", "seed", "thinking", "threads", "gguf")
    for k in [*order, *sorted((set(stored) | set(grid)) - set(order))]:
        if stored.get(k) != grid.get(k):
            there = _show(stored[k]) if k in stored else "not recorded, by an earlier dtrt"
            raise DtrtError(
                f"--resume {out}: the grid differs from the run there ({k}: {_show(grid.get(k))} here, "
                f"{there} there); pass the same flags, or start a new --out"
            )
    return RecordLog(out).load()


def _show(v) -> str:
    """A grid value in a message; None (a quantization the spec left to the export or backend) as `default`."""
    if isinstance(v, list):
        return ",".join("default" if x is None else str(x) for x in v)
    return "default" if v is None else str(v)

"""A bench run's directory. While it runs: run.json (the grid, written first) and records.jsonl (every finished
record appended at once). When it ends (or is interrupted): bench.json (the command, the machine line, the
configuration and a summary row per method x dataset x temperature), bench.md, bench.png, and the records packed
into records.jsonl.xz, which replaces records.jsonl: the small files are what a reader needs, the packed records
what `dtrt bench --resume OUT` and a new summary need. `--resume` reads them, refuses a different grid, and redoes
nothing that is recorded."""

import json
import lzma
import os
from pathlib import Path

from dtrt.errors import DtrtError

RUN, RECORDS, PACKED, REPORT = "run.json", "records.jsonl", "records.jsonl.xz", "bench.json"


class RecordLog:
    """records.jsonl where it exists (the whole log: a resumed run unpacks the packed records into it first), else
    records.jsonl.xz."""

    def __init__(self, out: Path):
        self.path = Path(out) / RECORDS
        self.packed = Path(out) / PACKED

    def load(self) -> list[dict]:
        """The records of an earlier run (a last line cut short by a kill is dropped)."""
        if self.path.is_file():
            return _parse(self.path.read_text().splitlines(), self.path)
        if self.packed.is_file():
            return _parse(lzma.decompress(self.packed.read_bytes()).decode().splitlines(), self.packed)
        return []

    def append(self, record: dict):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def unpack(self):
        """Before a resumed run appends: the packed records as the plain log, so that the log stays whole."""
        if not self.path.is_file() and self.packed.is_file():
            _atomic(self.path, _lines(self.load()).encode())

    def pack(self):
        """records.jsonl.xz from the log, then the plain log dropped (a kill in between leaves both, the same
        records)."""
        if not self.path.is_file():
            return
        _atomic(self.packed, lzma.compress(_lines(self.load()).encode(), preset=9 | lzma.PRESET_EXTREME))
        self.path.unlink()


def _parse(lines: list[str], path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise DtrtError(f"{path}:{i + 1}: not a JSON record; the file was edited") from None
    return out


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _atomic(path: Path, data: bytes):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_report(out: Path) -> dict:
    """A finished (or interrupted) run's report: bench.json's command, machine, config, failed and summary, with
    every record (from records.jsonl.xz; a bench.json written before the records were packed holds its own)."""
    path = Path(out) / REPORT
    if not path.is_file():
        raise DtrtError(f"{out}: no {REPORT} there; it is not the --out of a finished or interrupted dtrt bench")
    report = json.loads(path.read_text())
    if "records" not in report:
        report["records"] = RecordLog(out).load()
    return report


def check_new(out: Path):
    """A new run must not write into the --out of another run's records."""
    if (Path(out) / RECORDS).is_file() or (Path(out) / PACKED).is_file():
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
    log = RecordLog(out)
    log.unpack()
    return log.load()


def _show(v) -> str:
    """A grid value in a message; None (a quantization the spec left to the export or backend) as `default`."""
    if isinstance(v, list):
        return ",".join("default" if x is None else str(x) for x in v)
    return "default" if v is None else str(v)

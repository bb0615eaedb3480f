"""The limits of the GPU machine a job runs on, as the user gives them: a limits file (TOML or JSON) and/or
`--limit KEY=VALUE` flags, the flags winning. Nothing has a default that describes a machine: a limit the plan
needs and nobody gave is refused in one line. Sizes are bytes or a number with a unit (`64 MiB`, `1.5GB`), times
seconds or a number with a unit (`600`, `10 min`, `1h`)."""

import json
import re
import tomllib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

MiB = 1 << 20

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
TIME_UNITS = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}


class LimitsError(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    call_bytes: int  # what one call may carry: the working tree that travels and the staged part
    return_files: int  # files one call may bring back
    return_file_bytes: int  # the largest file one call may bring back
    return_bytes: int  # everything one call brings back
    call_s: int  # one command's wall-clock limit
    total_s: int  # the whole job: the machine's start, every call and every second between calls
    start_s: int  # the machine's start, counted in total_s
    gap_s: int  # between two calls: the transfers and the next call's start
    idle_s: int  # idle this long, the machine goes back and what the calls left on it is lost
    part_bytes: int | None = None  # one staged part (default: call_bytes less the tree that travels and 1 MiB)
    command_chars: int | None = None  # the longest command a call takes
    return_depth: int | None = None  # folders a returned file may lie under
    scratch_dir: str = "~/dtrt-job"  # on the GPU machine, a folder that lasts from one call to the next
    missing_packages: tuple[str, ...] = ()  # Python packages the GPU machine lacks (the dry run hides them too)


SIZES = {"call_bytes", "return_file_bytes", "return_bytes", "part_bytes"}
TIMES = {"call_s", "total_s", "start_s", "gap_s", "idle_s"}
COUNTS = {"return_files", "command_chars", "return_depth"}
KEYS = [f.name for f in fields(Limits)]
REQUIRED = [f.name for f in fields(Limits) if f.default is MISSING]


def _number(text: str, units: dict, what: str, where: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise LimitsError(f"{where}: {text!r} is not {what}")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def size(text, where: str) -> int:
    return _number(text, SIZE_UNITS, "a size (bytes, or e.g. 64 MiB)", where)


def _value(key: str, raw, where: str):
    if key in SIZES:
        return size(raw, where)
    if key in TIMES:
        return _number(raw, TIME_UNITS, "a time (seconds, or e.g. 10 min)", where)
    if key in COUNTS:
        return _number(raw, {"": 1}, "a whole number", where)
    if key == "missing_packages":
        names = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise LimitsError(f"{where}: {raw!r} is not a list of package names")
        return tuple(n.strip() for n in names if n.strip())
    if not isinstance(raw, str) or not raw:
        raise LimitsError(f"{where}: {raw!r} is not a folder")
    return raw


def read_file(path) -> dict:
    """The raw key/value pairs of a limits file (`.toml`, or `.json`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise LimitsError(
            f"--limits {path}: {e.strerror}; give a limits file (docs/training.md has one to copy)"
        ) from None
    try:
        found = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise LimitsError(f"--limits {path}: not {kind} ({e})") from None
    if not isinstance(found, dict):
        raise LimitsError(f"--limits {path}: not a table of limits")
    return found


def load(path=None, flags=()) -> Limits:
    """The limits from the file at `path` (if any), then the `KEY=VALUE` flags; refuses an unknown key, a value of
    the wrong kind and a required limit nobody gave, each in one line."""
    given = {}
    sources = [(k, v, f"--limits {path}: {k}") for k, v in (read_file(path) if path else {}).items()]
    for flag in flags:
        key, eq, raw = flag.partition("=")
        if not eq:
            raise LimitsError(f"--limit {flag}: not KEY=VALUE (e.g. --limit call_s=600)")
        sources.append((key.strip(), raw.strip(), f"--limit {flag}"))
    for key, raw, where in sources:
        if key not in KEYS:
            raise LimitsError(f"{where}: not a limit; the limits are {', '.join(KEYS)}")
        given[key] = _value(key, raw, where)
    missing = [k for k in REQUIRED if k not in given]
    if missing:
        raise LimitsError(
            f"limits: {', '.join(missing)} not given; set them in a limits file (--limits FILE, docs/training.md has "
            "one to copy) or as --limit KEY=VALUE"
        )
    return Limits(**given)

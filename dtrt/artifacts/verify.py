"""Checking an artifact's files against the sha256 its manifest records.

Hashing a multi-GB export on every start would cost seconds, so every load checks each file's size, and hashes
the files whose stamp (inode, size, modification and change times: dtrt.artifacts.memo.file_stamp; a write that puts
back the size and modification time still changes the change time) differs from the last state verified on this
machine (kept under `$DTRT_CACHE/verified/`, never inside the artifact: the runtime does not write artifacts). A
producer records that state right after writing, so the first load hashes nothing. `dtrt verify DIR` hashes every
file.
"""

import hashlib
import json
from pathlib import Path

from dtrt.artifacts.files import MANIFEST, cache_dir, sha256, write_cache_file
from dtrt.artifacts.memo import file_stamp
from dtrt.errors import DtrtError


def _state_path(root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
    return cache_dir() / "verified" / f"{key}.json"


def _read_state(root: Path) -> dict:
    try:
        state = json.loads(_state_path(root).read_text())
        return state if isinstance(state, dict) and state.get("root") == str(root.resolve()) else {}
    except (OSError, ValueError):
        return {}


def record_verified(root: Path, files: dict[str, dict]):
    """Remember that `files` (name -> {"size", "sha256"}) under `root` are verified as they are now. A cache that
    cannot be written only means the next load hashes again."""
    state = {"root": str(root.resolve()), "files": {n: [*file_stamp(root / n), m["sha256"]] for n, m in files.items()}}
    write_cache_file(_state_path(root), json.dumps(state))


def _entry(meta) -> bool:
    return isinstance(meta, dict) and isinstance(meta.get("size"), int) and isinstance(meta.get("sha256"), str)


def check_files(root: Path, files: dict[str, dict] | None, fix: str, full: bool = False) -> list[str]:
    """Every file of the manifest's table present with its size, and its sha256 where its stamp changed since the
    last verification (every file when `full`); the first mismatch raises, naming the file and `fix` (the command
    that writes the artifact again); so does a missing or malformed table. Returns the names that were hashed."""
    if not files or not isinstance(files, dict) or not all(_entry(m) for m in files.values()):
        raise DtrtError(f"{root / MANIFEST}: no table of its files' sizes and sha256 (incomplete or edited); {fix}")
    known = {} if full else _read_state(root).get("files", {})
    hashed = []
    for name, meta in files.items():
        f = root / name
        if not f.is_file():
            raise DtrtError(f"{f}: missing; {fix}")
        stamp = file_stamp(f)
        if (size := stamp[1]) != meta["size"]:
            raise DtrtError(f"{f}: {size} bytes, the manifest records {meta['size']} (truncated or modified); {fix}")
        if known.get(name) == [*stamp, meta["sha256"]]:
            continue
        hashed.append(name)
        if sha256(f) != meta["sha256"]:
            raise DtrtError(f"{f}: its sha256 differs from the manifest's (the file was modified); {fix}")
    if hashed:
        record_verified(root, files)
    return hashed

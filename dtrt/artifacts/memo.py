"""What a start works out from files and can reuse while they stay as they are: a JSON value under
`$DTRT_CACHE/memo/`, keyed by what it is (`kind`, which names the rule and its version) and by each file's resolved
path and stamp (inode, size, modification and change times in ns). A file written or replaced since changes its
stamp, so its value is worked out again; a cache that cannot be read or written only means the work is done again
(as dtrt.artifacts.verify's state of verified files).

It keeps a start from redoing, on files that have not changed: the sha256 of a source checkpoint's weights (seconds
for a multi-GB target, on every load of its first-use export), which stages want dtrt's ONNX Runtime kernels
(importing onnx to read a graph costs 0.6 s), the tokenizer class transformers' AutoTokenizer picks (it imports
the model's config class for that: about a second), and the record a lean tokenizer runs from (its serialized backend:
2 MB for SmolLM2's, 9 MB for Qwen3's; dtrt.runtime.lean_tokenizer).
"""

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtrt.artifacts.files import cache_dir, sha256, write_cache_file


def file_stamp(path: Path) -> list[int]:
    """[inode, size, mtime_ns, ctime_ns] of a file (OSError where there is none): a write changes the change time
    even where the size and modification time are put back, and a copy or a replacement changes the inode."""
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp(path: Path) -> list:
    """[resolved path, *file_stamp], or [path, None] where there is no such file."""
    try:
        path = path.resolve()
        return [str(path), *file_stamp(path)]
    except OSError:
        return [str(path), None]


def _entry(kind: str, paths: Sequence[Path]) -> tuple[Path, str]:
    key = json.dumps([kind, [_stamp(Path(p)) for p in paths]])
    return cache_dir() / "memo" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json", key


def _read(entry: Path, key: str) -> Any:
    try:
        record = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    return record.get("value") if isinstance(record, dict) and record.get("key") == key else None


def stamped(kind: str, paths: Sequence[Path], compute: Callable[[], Any]) -> Any:
    """`compute()` (a JSON value, never None), or the value it gave for these files as they are now. The stamps are
    taken before computing: a file that changes meanwhile leaves a value no later call finds."""
    entry, key = _entry(kind, paths)
    value = _read(entry, key)
    if value is None:
        value = compute()
        write_cache_file(entry, json.dumps({"key": key, "value": value}))
    return value


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed again only where the file changed since the last time."""
    return stamped("sha256", [path], lambda: sha256(path))


def checkpoint_hashes(path: Path) -> dict[str, str]:
    """sha256 of config.json and every safetensors file (and index) of a checkpoint directory, each hashed again
    only where the file changed since: a first-use export is checked against its checkpoints on every load, and
    hashing a multi-GB target took seconds of each start."""
    names = sorted(p.name for p in path.iterdir() if p.name == "config.json" or ".safetensors" in p.name)
    return {n: file_sha256(path / n) for n in names}

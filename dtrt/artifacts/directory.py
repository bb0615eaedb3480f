"""`dtrt verify DIR`: an artifact directory of either kind (an export or an engine directory), every file hashed
against its manifest."""

import json
from pathlib import Path

from dtrt.artifacts.engine import FORMAT as ENGINE
from dtrt.artifacts.engine import read_engine
from dtrt.artifacts.export import load_export
from dtrt.artifacts.files import MANIFEST


def verify_dir(path: Path) -> tuple[int, int]:
    """`dtrt verify`: hash every file of an export or engine directory; (files, bytes), or the first mismatch as
    a one-line error naming the file and the command that writes the artifact again."""
    try:
        fmt = json.loads((path / MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    art = read_engine(path, full_check=True) if fmt == ENGINE else load_export(path, full_check=True)
    files = art.manifest["files"]
    return len(files), sum(m["size"] for m in files.values())

"""A checkpoint folder as files a call may bring back (each at most the largest file a call may bring back): its
config and weights' sha256 in `<prefix>.json`, the weights cut into `<prefix>-<i>.bin`; and the folder rebuilt
from them, checked."""

import hashlib
import json
import os
from pathlib import Path

from parts import PartsError


def _write(path: Path, data: bytes):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def export(checkpoint: Path, out: Path, *, piece_bytes: int | None, prefix: str = "drafter", extra: dict | None = None):
    """Write the pieces first and the record last, so a record always names pieces that are there whole.
    `piece_bytes` None: the weights in one piece."""
    checkpoint, out = Path(checkpoint), Path(out)
    weights = (checkpoint / "model.safetensors").read_bytes()
    piece_bytes = piece_bytes or max(1, len(weights))
    pieces = [weights[i : i + piece_bytes] for i in range(0, len(weights), piece_bytes)]
    names = []
    for i, piece in enumerate(pieces, 1):
        names.append(f"{prefix}-{i}.bin")
        _write(out / names[-1], piece)
    for stale in out.glob(f"{prefix}-*.bin"):
        if stale.name not in names:
            stale.unlink()
    record = {
        "config": json.loads((checkpoint / "config.json").read_text()),
        "sha256": hashlib.sha256(weights).hexdigest(),
        "bytes": len(weights),
        "pieces": names,
        **(extra or {}),
    }
    _write(out / f"{prefix}.json", (json.dumps(record, indent=1) + "\n").encode())
    return record


def rebuild(returned: Path, into: Path, *, prefix: str = "drafter") -> dict:
    """`into`/config.json and model.safetensors from the returned files; refuses a missing or corrupted piece."""
    returned, into = Path(returned), Path(into)
    rec_path = returned / f"{prefix}.json"
    if not rec_path.is_file():
        raise PartsError(f"{rec_path}: not there; the call brought no checkpoint back")
    record = json.loads(rec_path.read_text())
    missing = [n for n in record["pieces"] if not (returned / n).is_file()]
    if missing:
        raise PartsError(f"{returned}: missing {', '.join(missing)}; the checkpoint came back in part only")
    weights = b"".join((returned / n).read_bytes() for n in record["pieces"])
    if len(weights) != record["bytes"] or hashlib.sha256(weights).hexdigest() != record["sha256"]:
        raise PartsError(f"{returned}: the pieces are not the checkpoint {rec_path.name} names (size or sha256)")
    into.mkdir(parents=True, exist_ok=True)
    _write(into / "model.safetensors", weights)
    _write(into / "config.json", (json.dumps(record["config"], indent=2) + "\n").encode())
    return record

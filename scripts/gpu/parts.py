"""A staged folder as numbered parts that each fit one call: one tar of the folder cut into pieces, each piece in
its own folder with the manifest (every piece's size and sha256, and the whole tar's). `join` refuses a missing,
short or corrupted piece in one line before anything is unpacked."""

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_ROOM = 4096  # of a part's bytes, kept for the manifest beside its piece


class PartsError(Exception):
    pass


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(folder: Path, out: Path, *, part_bytes: int, prefix: str = "part") -> list[Path]:
    """`out`/<prefix>-1 ... -n: the tar of `folder` in pieces of at most `part_bytes` (with the manifest)."""
    folder, out = Path(folder), Path(out)
    tar = out / f".{prefix}.tar"
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                t.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    data = tar.read_bytes()
    tar.unlink()
    room = part_bytes - MANIFEST_ROOM
    n = -(-len(data) // room)
    size = -(-len(data) // n)  # as even as they come: each call's margin under the limit is the same
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    manifest = {
        "tar_sha256": _sha(data),
        "tar_bytes": len(data),
        "parts": [{"name": f"{prefix}-{i}.bin", "bytes": len(p), "sha256": _sha(p)} for i, p in enumerate(pieces, 1)],
    }
    dirs = []
    for i, piece in enumerate(pieces, 1):
        d = out / f"{prefix}-{i}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        (d / f"{prefix}-{i}.bin").write_bytes(piece)
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        dirs.append(d)
    return dirs


def check(part_dir: Path) -> dict:
    """The manifest of one part's folder, once its own piece is there whole."""
    part_dir = Path(part_dir)
    if not (part_dir / MANIFEST).is_file():
        raise PartsError(f"{part_dir}: no {MANIFEST}; stage the job again (scripts/gpu/job.py stage)")
    manifest = json.loads((part_dir / MANIFEST).read_text())
    mine = [p for p in manifest["parts"] if (part_dir / p["name"]).exists()]
    if len(mine) != 1:
        raise PartsError(f"{part_dir}: holds {len(mine)} of its parts' pieces, not 1")
    _verify(part_dir / mine[0]["name"], mine[0])
    return manifest


def _verify(path: Path, want: dict) -> bytes:
    data = path.read_bytes()
    if len(data) != want["bytes"]:
        raise PartsError(f"{path}: {len(data)} bytes, not {want['bytes']}: a partial copy; send this part again")
    if _sha(data) != want["sha256"]:
        raise PartsError(f"{path}: its sha256 is not the manifest's: a corrupted copy; send this part again")
    return data


def join(part_dirs: list[Path], into: Path) -> Path:
    """Unpack the parts into `into` once every piece is there and whole; nothing is written otherwise."""
    part_dirs = [Path(d) for d in part_dirs]
    manifests = [json.loads((d / MANIFEST).read_text()) for d in part_dirs if (d / MANIFEST).is_file()]
    if not manifests:
        raise PartsError(f"{', '.join(map(str, part_dirs))}: no part (and no {MANIFEST}) is there")
    manifest = manifests[0]
    if any(m["tar_sha256"] != manifest["tar_sha256"] for m in manifests):
        raise PartsError("the parts come from two different stagings; stage once and send every part again")
    found = {p.name: p for d in part_dirs if d.is_dir() for p in d.iterdir() if p.suffix == ".bin"}
    missing = [p["name"] for p in manifest["parts"] if p["name"] not in found]
    if missing:
        raise PartsError(f"missing {', '.join(missing)} of {len(manifest['parts'])} parts: refusing a partial copy")
    data = b"".join(_verify(found[p["name"]], p) for p in manifest["parts"])
    if _sha(data) != manifest["tar_sha256"]:
        raise PartsError("the joined parts are not the staged tar (sha256); stage once and send every part again")
    into = Path(into)
    tmp = into.with_name(into.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tar = tmp / ".staged.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(tmp, filter="data")
    tar.unlink()
    shutil.rmtree(into, ignore_errors=True)
    tmp.rename(into)
    return into

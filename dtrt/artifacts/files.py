"""Files of an artifact directory: sha256, the manifest's file table, and staging (a directory is written under
a temporary name next to its destination and renamed into place only when complete)."""

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dtrt.errors import DtrtError

MANIFEST = "manifest.json"
# .<name>.tmp-<host>-<pid>-<random> while being written; .<name>.old-<host>-<pid> while an older copy is swapped out
_STAGED = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>[^-]+)-(?P<pid>\d+)(?:-.*)?$")


def host_tag() -> str:
    """This machine in staging names: a cache shared between machines must not take another's live writer for a
    dead one."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def cache_dir() -> Path:
    """Where dtrt keeps what it makes on first use (`$DTRT_CACHE`, default ~/.cache/dtrt)."""
    return Path(os.environ.get("DTRT_CACHE", Path.home() / ".cache" / "dtrt"))


MOVE_HINT = "free space there, or write elsewhere (`dtrt export --out DIR`; DTRT_CACHE moves dtrt's cache)"


def free_space(path: Path) -> int | None:
    """Bytes free to this user on the file system that holds `path` (or, where it does not exist yet, its nearest
    existing parent); None where that cannot be read."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def require_space(out: Path, need: int, what: str, hint: str = MOVE_HINT):
    """A one-line refusal, before anything is written, when writing `need` bytes at `out` (`what`: the writing, as a
    sentence's subject; `hint`: the ways out) would not fit on its disk."""
    free = free_space(Path(out).parent)
    if free is not None and free < need:
        gb = f"about {need / 1e9:.2f} GB at {out} and that disk has {free / 1e9:.2f} GB free"
        raise DtrtError(f"{what} writes {gb}: {hint}")


FULL = (errno.ENOSPC, errno.EDQUOT)
# what the file system refuses whatever dtrt does: a read-only disk, a path the user may not write, one that runs
# through a file
REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


def file_system_error(e: OSError) -> str | None:
    """The one line a command ends with when the file system refuses a write (or a read) it needs, None for any other
    error. What was being written was staged, and is gone."""
    if e.errno not in FULL and not (e.errno in REFUSED and e.filename):  # a refusal that names no file is no path's
        return None
    reason = os.strerror(e.errno).lower()
    if e.errno in FULL:  # an estimate before writing refuses most of these; another writer can still fill a disk
        where = f" writing {e.filename}" if e.filename else f" while writing (dtrt's cache is {cache_dir()})"
        return f"{reason}{where}: {MOVE_HINT}; nothing half-written was kept"
    return (
        f"{e.filename}: {reason}; dtrt writes what it makes on first use under {cache_dir()} (DTRT_CACHE "
        "moves it) and an export where --out says; nothing half-written was kept"
    )


def write_cache_file(path: Path, text: str) -> bool:
    """`text` into `path` whole or not at all (a temporary file renamed over it); False where it cannot be written,
    which for a cache only means the work is done again next time."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_table(root: Path) -> dict[str, dict]:
    """Relative path -> {"size", "sha256"} for every file under `root` except the manifest."""
    return {
        str(f.relative_to(root)): {"size": f.stat().st_size, "sha256": sha256(f)}
        for f in sorted(root.rglob("*"))
        if f.is_file() and f != root / MANIFEST
    }


def write_manifest(root: Path, manifest: dict):
    """manifest.json with the size and sha256 of every file under `root`; everything made world-readable."""
    manifest["files"] = file_table(root)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for f in root.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    root.chmod(0o755)


def _remove(path: Path):
    """Remove a directory tree, a file or a symlink (not what it points to); whatever cannot be removed stays."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clear_stale(parent: Path) -> list[Path]:
    """Remove the staging directories under `parent` whose writing process, on this machine, no longer runs (killed
    mid-write). A swapped-out older copy whose replacement never arrived (killed between the two renames) is put
    back instead."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        m = _STAGED.match(entry.name)
        # a staging directory, or an older copy swapped out (a directory, or what `out` was: a file, a symlink)
        if not m or m["host"] != host_tag() or _alive(int(m["pid"])):
            continue
        if m["kind"] == "old":
            dest = parent / m["name"]
            if not (dest.exists() or dest.is_symlink()):
                os.replace(entry, dest)
                continue
        elif not (entry.is_dir() and not entry.is_symlink()):
            continue
        _remove(entry)
        removed.append(entry)
    return removed


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh directory next to `out` that replaces `out` when the block ends without an error (an existing `out`
    is swapped out, then removed) and is removed when it raises. Stale staging directories of processes that no
    longer run are cleared first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clear_stale(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{host_tag()}-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists() or out.is_symlink():
            old = out.with_name(f".{out.name}.old-{host_tag()}-{os.getpid()}")
            _remove(old)
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None:  # put the older copy back
                os.replace(old, out)
            raise
        if old is not None:
            _remove(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

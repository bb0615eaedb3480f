"""Every file git tracks stays under 1 MiB unless ALLOWED names it with its reason: the repository carries the
product, not raw records or data a command writes again (a bench record packs its records, docs/benchmarks.md;
drafter data comes from `dtrt drafter-data`)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1 << 20
ALLOWED = {
    "dtrt/assets/smollm2-135m/domino/model.safetensors": "the shipped drafter's weights (31.6 MB in bf16)",
}


def tracked(root: Path) -> dict[str, int]:
    """Each tracked file's size in the working tree (one deleted there, or a submodule, is left out)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    sizes = {}
    for name in out.decode().split("\0"):
        path = root / name
        if name and path.is_file():
            sizes[name] = path.stat().st_size
    return sizes


def oversized(sizes: dict[str, int], allowed=ALLOWED, limit: int = LIMIT) -> list[str]:
    return sorted(
        f"{name}: {size / 1e6:.1f} MB" for name, size in sizes.items() if size >= limit and name not in allowed
    )


def in_git_checkout(root: Path) -> bool:
    if shutil.which("git") is None:
        return False
    got = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    return got.returncode == 0 and Path(got.stdout.strip()).resolve() == root.resolve()


@pytest.mark.skipif(not in_git_checkout(ROOT), reason="not a git checkout")
def test_tracked_files_are_small_or_allowed():
    sizes = tracked(ROOT)
    big = oversized(sizes)
    assert not big, f"tracked files of 1 MiB or more: {', '.join(big)}; keep them out of git or add them to ALLOWED"
    assert set(ALLOWED) <= set(sizes), "ALLOWED names a file git does not track; take it out"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_check_fails_on_a_big_new_file(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "small.txt").write_text("x")
    (tmp_path / "big.bin").write_bytes(os.urandom(LIMIT))
    (tmp_path / "shipped.bin").write_bytes(bytes(LIMIT + 1))
    (tmp_path / "untracked.bin").write_bytes(bytes(2 * LIMIT))
    subprocess.run(["git", "add", "small.txt", "big.bin", "shipped.bin"], cwd=tmp_path, check=True)
    sizes = tracked(tmp_path)
    assert set(sizes) == {"small.txt", "big.bin", "shipped.bin"}
    assert oversized(sizes, allowed={"shipped.bin": "why"}) == ["big.bin: 1.0 MB"]
    assert oversized(sizes, allowed={"big.bin": "why", "shipped.bin": "why"}) == []

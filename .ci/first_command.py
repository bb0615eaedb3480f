"""The README's first command as a new user runs it: its set-up line for generation, read from the README's "Set up"
section and run exactly as written in a fresh virtual environment, with an empty HOME and no dtrt cache, from the
repository root. Fails unless the line exits 0 and its answer is the one the README says it prints.

Standard library only: it runs before anything is installed."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from readme import setup_lines

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    line, expected, _ = setup_lines((REPO / "README.md").read_text())
    with tempfile.TemporaryDirectory(prefix="dtrt-newcomer-") as tmp:
        home, venv = Path(tmp) / "home", Path(tmp) / "venv"
        home.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRT_", "VIRTUAL_ENV", "PYTHON"))}
        env |= {"HOME": str(home), "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}
        env.pop("XDG_CACHE_HOME", None)
        print(f"newcomer: {line}", flush=True)
        # a full disk fails the line too (the first use writes about 1 GB into the cache): say what there was
        print(f"newcomer: {shutil.disk_usage(tmp).free / 1e9:.1f} GB free on the disk of {tmp}", flush=True)
        start = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", line], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        took = time.monotonic() - start
    answer = done.stdout.strip().splitlines()[-1].strip() if done.stdout.strip() else ""
    print(f"newcomer: exit {done.returncode} after {took:.0f} s; answered: {answer}", flush=True)
    if done.returncode != 0:
        print("\n".join(done.stdout.splitlines()[-20:]))
        print(f"newcomer: FAILED, the README's first command exited {done.returncode}", flush=True)
        return 1
    if answer != expected:
        print(f"newcomer: FAILED, the README says it answers {expected!r}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

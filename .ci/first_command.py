"""The README's first command as a new user runs it: its set-up line for generation, read from the README's "Set up"
section and run exactly as written in a fresh virtual environment, with an empty HOME and no dtrt cache, from the
repository root. Fails unless the line exits 0 and its answer is the one the README says it prints.

Standard library only: it runs before anything is installed."""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def first_command(readme: str) -> tuple[str, str]:
    """(the set-up line that runs the embedded default, the answer the README says it prints)."""
    section = readme.split("## Set up", 1)
    if len(section) != 2:
        sys.exit("README.md: no '## Set up' section")
    body = section[1].split("\n## ", 1)[0]
    lines = [ln for ln in re.findall(r"```bash\n(.*?)```", body, re.S)[0].splitlines() if ln.strip()]
    if len(lines) != 1 or "dtrt run " not in lines[0]:
        sys.exit("README.md: the first block under 'Set up' must be the one line that installs and runs dtrt run")
    answer = re.search(r"prints the answer, `([^`]+)`", body)
    if answer is None:
        sys.exit("README.md: the 'Set up' section must say what the first command prints (prints the answer, `...`)")
    return lines[0], answer.group(1)


def main() -> int:
    line, expected = first_command((REPO / "README.md").read_text())
    with tempfile.TemporaryDirectory(prefix="dtrt-newcomer-") as tmp:
        home, venv = Path(tmp) / "home", Path(tmp) / "venv"
        home.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRT_", "VIRTUAL_ENV", "PYTHON"))}
        env |= {"HOME": str(home), "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}
        env.pop("XDG_CACHE_HOME", None)
        print(f"newcomer: {line}", flush=True)
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

"""The README's two set-up lines, as CI runs them: the first block under "Set up" installs and runs the embedded
default (with the answer the README says it prints), the second installs everything and runs the tests.

`python3 .ci/readme.py test-line` prints the second. Standard library only: it runs before anything is installed."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def setup_lines(text: str) -> tuple[str, str, str]:
    """(the line that runs the embedded default, the answer it prints, the line that runs the tests)."""
    section = text.split("\n## Set up\n", 1)
    if len(section) != 2:
        sys.exit("README.md: no '## Set up' section")
    body = section[1].split("\n## ", 1)[0]
    blocks = [[ln for ln in b.splitlines() if ln.strip()] for b in re.findall(r"```bash\n(.*?)```", body, re.S)]
    if len(blocks) < 2 or any(len(b) != 1 for b in blocks[:2]):
        sys.exit("README.md: 'Set up' must open with two one-line bash blocks (run the default; run the tests)")
    run, test = blocks[0][0], blocks[1][0]
    if "dtrt run " not in run or "pytest" not in test:
        sys.exit("README.md: the first 'Set up' line must end in dtrt run, the second in pytest")
    answer = re.search(r"prints the answer, `([^`]+)`", body)
    if answer is None:
        sys.exit("README.md: the 'Set up' section must say what the first line prints (prints the answer, `...`)")
    return run, answer.group(1), test


if __name__ == "__main__":
    if sys.argv[1:] != ["test-line"]:
        sys.exit("usage: python3 .ci/readme.py test-line")
    print(setup_lines(README.read_text())[2])

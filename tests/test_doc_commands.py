"""Every `dtrt ...` command line in the README and docs/ parses with the real CLI: its command exists, every flag is
one the command has, every value is of the flag's type and among its choices. (A README command the CLI refused,
`dtrt export --dtype bf16`, is what this test is for.) The commands are not run here."""

import re
import shlex
from pathlib import Path

import click
import pytest

from dtrt.cli import cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("dtrt/assets/*/*.md"))]


def commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for each line of a ```bash block that runs `dtrt`, continuation lines joined; a trailing
    comment, a redirection and anything after `&&`, `|` or `;` are left out."""
    found, block, shell, start, pending = [], False, False, 0, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            block, pending = not block, ""
            shell = block and line.strip()[3:] in ("bash", "sh", "console")
            continue
        if not shell:
            continue
        if not pending:
            start = n
        text = pending + " " + line.strip() if pending else line.strip()
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        text = re.split(r"\s#\s|\s#$|\s&&\s|\s\|\s|\s;\s|\s>\s", text)[0].strip()
        if text.startswith("dtrt "):
            found.append((start, text))
    return found


CASES = [(f"{p.relative_to(REPO)}:{n}", c) for p in DOCS for n, c in commands(p)]


def test_the_docs_have_commands():
    assert len(CASES) > 60


def refusal(command: str) -> str | None:
    """Why the CLI refuses to parse `command`, or None when it parses."""
    args = [a for a in shlex.split(command)[1:] if a != "..."]  # "...": more flags, not written out
    with click.Context(cli) as ctx:
        try:
            name, cmd, rest = cli.resolve_command(ctx, args)
            cmd.make_context(name, rest, parent=ctx)
        except click.UsageError as e:
            return e.format_message()
    return None


@pytest.mark.parametrize("where,command", CASES, ids=[w for w, _ in CASES])
def test_a_documented_command_parses(where, command):
    assert refusal(command) is None, f"{where}: `{command}`: {refusal(command)}"


def test_a_wrong_command_in_the_docs_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\ndtrt export --model tiny --dtype bf17 --out x   # a comment\n"
        'dtrt run --no-such-flag \\\n    "hi"\ndtrt frobnicate\n```\n```\ndtrt not a command\n```\n'
    )
    found = commands(doc)
    assert [n for n, _ in found] == [2, 3, 5]
    assert "bf17" in refusal(found[0][1]) and "--no-such-flag" in refusal(found[1][1])
    assert "frobnicate" in refusal(found[2][1])
    assert refusal("dtrt export --model tiny --dtype bf16 --out x") is None

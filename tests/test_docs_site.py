"""The documentation site builds: `mkdocs build --strict` over mkdocs.yml, so a page left out of the nav, a link
between pages or to an anchor that does not resolve, or a link out of docs/ fails it (every warning is an error);
the CLI reference is generated from dtrt.cli. The README is not part of the site: its links into docs/ are checked
against the built pages here. Skips only where mkdocs is not installed (the test extra installs it)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs mkdocs (the test extra)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert not re.search(r"^WARNING\b", log, re.M), log
    return out


def test_the_site_builds_strictly_with_the_cli_reference(site):
    cli = (site / "cli" / "index.html").read_text()
    for command in ("run", "serve", "export", "bench", "train-drafter", "draft-vocab"):
        assert f"dtrt {command}" in cli, command
    assert "--max-new-tokens" in cli and "Sentinel" not in cli  # the flags, as --help prints them


def test_the_readme_links_into_the_built_pages(site):
    links = re.findall(r"\]\(docs/([\w.-]+)\.md(?:#([\w-]+))?\)", (REPO / "README.md").read_text())
    assert len(links) > 10
    for page, anchor in links:
        html = site / ("" if page == "index" else page) / "index.html"
        assert html.is_file(), f"README links to docs/{page}.md, which is not a page of the site"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README: docs/{page}.md has no anchor #{anchor}"

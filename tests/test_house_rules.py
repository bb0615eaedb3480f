"""The house rules, run with the suite so a change cannot quietly break them: ruff (lint and format) and the
import-linter contracts in pyproject.toml (the layers of DESIGN.md section 1; the bench off the trainer)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_lint_and_format():
    lint = run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_import_layers():
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[test]')")
    # the contract checks the dtrt this interpreter imports, which is this checkout (installed editable)
    out = run(sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_no_import_loops():
    """No module imports, directly or through others, a module that imports it, function-level imports included
    (those closed loops only by hiding them); annotations under TYPE_CHECKING do not run, so they do not count."""
    grimp = pytest.importorskip("grimp", reason="grimp is not installed (pip install -e '.[test]')")
    graph = grimp.build_graph("dtrt", exclude_type_checking_imports=True)
    loops = [
        f"{a} -> {' -> '.join(back)}"
        for a in sorted(graph.modules)
        for b in sorted(graph.find_modules_directly_imported_by(a))
        if (back := graph.find_shortest_chain(importer=b, imported=a))
    ]
    assert loops == []


def test_running_imports_no_exporter():
    """`dtrt run` and `dtrt serve` import neither onnx nor onnxscript (seconds of a one-shot run's start): the
    exporter and the ops' ONNX functions are imported only to export."""
    code = (
        "import sys; import dtrt.cli, dtrt.launch, dtrt.runtime.pipeline, dtrt.runtime.backends.onnxruntime, "
        "dtrt.runtime.backends.tensorrt, dtrt.serve.server, dtrt.launch.first_use; "
        "print(sorted({'onnx', 'onnxscript'} & set(sys.modules)))"
    )
    out = run(sys.executable, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_design_sections_cited_in_the_code_are_the_right_ones():
    """A module that cites `DESIGN.md section N` names a section that exists, and the packages cite the section
    about them (the numbers moved when sections were added)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    headings = dict(re.findall(r"^## (\d+)\. (.+)$", (root / "docs" / "DESIGN.md").read_text(), re.M))
    cited = {}
    for path in sorted((root / "dtrt").rglob("*.py")):
        for n in re.findall(r"DESIGN\.md section (\d+)", path.read_text()):
            assert n in headings, f"{path.relative_to(root)} cites DESIGN.md section {n}, which does not exist"
            cited.setdefault(str(path.relative_to(root)), set()).add(headings[n])
    about = {
        "dtrt/ops/__init__.py": "plugin boundary",
        "dtrt/plugins/__init__.py": "plugin boundary",
        "dtrt/artifacts/__init__.py": "Artifacts",
        "dtrt/engines/__init__.py": "Artifacts",
        "dtrt/exporter/stage_modules.py": "stages",
        "dtrt/runtime/backends/torch.py": "stages",
    }
    for path, word in about.items():
        assert any(word in h for h in cited[path]), f"{path} cites {cited[path]}, not the section on {word}"

"""The house rules, run with the suite so a change cannot quietly break them: ruff (lint and format) and the
import-linter layer contract in pyproject.toml (DESIGN.md section 1)."""

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
    assert "1 kept, 0 broken" in out.stdout


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

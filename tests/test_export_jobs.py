"""`dtrt export --jobs 2`: the target stage written by a second process while this one writes the drafter stages,
into the same bytes as a one-process export (an export is the same bytes in every process); its failures, and what
picks the number of jobs."""

import hashlib
import signal

import pytest
from helpers import run_cli

from dtrt.errors import DtrtError
from dtrt.exporter import write as export_mod
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.target_writer import SecondProcess, TargetJob
from dtrt.exporter.write import export_pair


def digests(root) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_a_second_process_writes_the_same_bytes(tiny, tiny_export, tmp_path):
    logs = []
    exp = export_pair(tiny, tmp_path / "tiny", ExportConfig(max_context=512, jobs=2), model="tiny", log=logs.append)
    a, b = digests(exp.path), digests(tiny_export.path)
    assert {k for k in a if a[k] != b.get(k)} == set()
    assert any("exporting target in a second process" in m for m in logs)
    assert any(m.startswith("[1/") and "target done in" in m and "(in the second process)" in m for m in logs)


def test_jobs_are_one_or_two(tiny, tmp_path):
    for jobs in (0, 3):
        with pytest.raises(DtrtError, match=f"^--jobs {jobs}: use 1 or 2$"):
            export_pair(tiny, tmp_path / "x", ExportConfig(jobs=jobs))


def test_the_second_process_says_what_went_wrong(tiny, tmp_path):
    (tmp_path / "root").mkdir()
    job = TargetJob(target=tmp_path / "missing", dtype="fp32", taps=(1,), root=tmp_path / "root", max_context=64)
    with SecondProcess(job) as proc, pytest.raises(DtrtError) as e:  # a refusal: its one line, as is
        proc.result()
    assert "missing" in str(e.value) and "\n" not in str(e.value)
    bug = TargetJob(target=tiny.target, dtype="fp32", taps=(1,), root=tmp_path / "root", max_context=64, quant=1)
    with SecondProcess(bug) as proc, pytest.raises(RuntimeError, match="export process failed:\nTraceback"):
        proc.result()


def test_a_file_the_second_process_cannot_write_is_the_same_error_here(tiny, tmp_path):
    """A full disk or a directory it may not write reaches the command's one-line handling as the OSError it is."""
    job = TargetJob(target=tiny.target, dtype="fp32", taps=(1,), root=tmp_path / "gone", max_context=64)
    with SecondProcess(job) as proc, pytest.raises(FileNotFoundError) as e:
        proc.result()
    assert str(tmp_path / "gone") in str(e.value)


def test_a_second_process_that_dies_is_named(tiny, tmp_path):
    (tmp_path / "root").mkdir()
    job = TargetJob(target=tiny.target, dtype="fp32", taps=(1,), root=tmp_path / "root", max_context=64)
    with SecondProcess(job) as proc, pytest.raises(DtrtError, match=r"ended \(exit code -9\).*--jobs 1$"):
        proc.proc.send_signal(signal.SIGKILL)
        proc.result()


def test_a_failure_here_stops_the_second_process_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    started = []
    enter = SecondProcess.__enter__
    monkeypatch.setattr(SecondProcess, "__enter__", lambda self: started.append(enter(self)) or started[-1])

    def failing(stage, path, *a):
        raise RuntimeError("boom")

    monkeypatch.setattr(export_mod, "export_stage", failing)  # the first drafter stage, in this process
    with pytest.raises(RuntimeError, match="boom"):
        export_pair(tiny, tmp_path / "out" / "tiny", ExportConfig(max_context=64, jobs=2))
    assert started and started[0].proc.poll() is not None  # stopped, not left writing
    assert list((tmp_path / "out").iterdir()) == []


def test_the_command_picks_the_jobs_unless_told(tiny, tmp_path, monkeypatch, capsys):
    from dtrt.launch import memory

    made = []

    def export(pair, out, cfg, **kw):
        made.append(cfg.jobs)
        raise DtrtError("stop here")

    monkeypatch.setattr(export_mod, "export_pair", export)
    monkeypatch.setattr(memory, "export_jobs", lambda pair, dtype: 2)
    code, _, err = run_cli(monkeypatch, capsys, "export", "--target", str(tiny.target), "--out", str(tmp_path / "x"))
    assert (code, made) == (2, [2]) and "stop here" in err
    code, _, _ = run_cli(monkeypatch, capsys, "export", "--target", str(tiny.target), "--out", "y", "--jobs", "1")
    assert (code, made) == (2, [2, 1])
    code, _, err = run_cli(monkeypatch, capsys, "export", "--target", str(tiny.target), "--out", "y", "--jobs", "4")
    assert code != 0 and err.strip().splitlines() == ["error: --jobs 4: use 1 or 2"] and made == [2, 1]

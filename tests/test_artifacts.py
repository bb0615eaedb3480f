"""Artifact directories on disk (dtrt.artifacts): every file checked against the sha256 its manifest records, the
fast path that hashes only what changed since it was last verified (state kept under $DTRT_CACHE/verified/, never in
the artifact), `dtrt verify` hashing everything, and staging: a directory appears complete or not at all, and the
leftovers of a killed writer are removed by the next write in the same place."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_cli
from test_engines import fake_trt, write_export  # noqa: F401 (fixture)

import dtrt
from dtrt.artifacts import verify
from dtrt.artifacts.directory import verify_dir
from dtrt.artifacts.engine import read_engine
from dtrt.artifacts.export import FORMAT, load_export
from dtrt.artifacts.files import MANIFEST, cache_dir, clear_stale, host_tag, staging, write_manifest
from dtrt.artifacts.verify import check_files, record_verified
from dtrt.engines.build import build_engines
from dtrt.errors import DtrtError
from dtrt.zoo.registry import built_once

REPO = Path(dtrt.__file__).resolve().parent.parent

H = host_tag()  # staging names carry the machine


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$DTRT_CACHE in this test's tmp_path."""
    path = tmp_path / "cache"
    monkeypatch.setenv("DTRT_CACHE", str(path))
    return path


@pytest.fixture
def hashes(monkeypatch):
    """The paths verify hashes, in order."""
    seen = []
    real = verify.sha256

    def counting(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(verify, "sha256", counting)
    return seen


def small_export(path: Path) -> Path:
    """An export directory load_export accepts: a few files (one in a subdirectory) and their manifest."""
    path.mkdir(parents=True)
    (path / "target.onnx").write_bytes(b"graph" * 100)
    (path / "target.onnx.data").write_bytes(bytes(range(256)) * 40)
    (path / "tokenizer").mkdir()
    (path / "tokenizer" / "tokenizer.json").write_text('{"model": {}}')
    for f in path.rglob("*"):  # written an hour ago: a rewrite in the test gets another mtime on any filesystem
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns - 3600 * 10**9))
    manifest = {
        "format": FORMAT,
        "dtrt_version": dtrt.__version__,
        "dtype": "fp32",
        "max_context": 64,
        "budget": 16,
        "source": {"model": "tiny"},
        "stages": {"target": {"file": "target.onnx", "inputs": [], "outputs": []}},
    }
    write_manifest(path, manifest)
    return path


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def flip_byte(path: Path, at: int = 0):
    """Change one byte of `path` in place (same size)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def tamper_keeping_stamp(path: Path):
    """Change one byte of `path` and restore its size and modification time: only its change time (and hashing)
    can tell."""
    st = path.stat()
    flip_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def one_line_error(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# sha256 checks


def test_flipped_byte_in_a_weight_file_is_refused(tiny_export, tmp_path, cache):
    path = tmp_path / "tiny"
    shutil.copytree(tiny_export.path, path)
    load_export(path)  # verified as it is: the state is recorded
    data = path / "weights.data"
    size = data.stat().st_size
    flip_byte(data, size // 2)
    assert data.stat().st_size == size
    with pytest.raises(DtrtError) as e:
        load_export(path)
    msg = one_line_error(e)
    assert msg.startswith(f"{data}: its sha256 differs from the manifest's")
    assert "re-export with `dtrt export --model tiny --dtype fp32 --max-context 512 --budget 16" in msg
    assert msg.endswith(f" --out {path} --force`")


def test_first_load_of_a_copy_hashes_every_file(tiny_export, tmp_path, cache, hashes):
    """A copy (another path) has no verified state: its first load hashes every file, so a byte flipped in a
    copy whose timestamps were preserved is still caught."""
    path = tmp_path / "tiny"
    shutil.copytree(tiny_export.path, path)
    tamper_keeping_stamp(path / "weights.data")
    with pytest.raises(DtrtError, match=r"weights\.data: its sha256 differs .* --force`$"):
        load_export(path)


def test_fast_path_hashes_only_changed_files(tmp_path, cache, hashes):
    path = small_export(tmp_path / "exp")
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["target.onnx", "target.onnx.data", "tokenizer/tokenizer.json"]

    load_export(path)  # nothing recorded yet: every file hashed
    assert sorted(hashes) == sorted(path / n for n in files)
    hashes.clear()
    load_export(path)
    assert hashes == []
    assert check_files(path, files, "fix") == []

    # a rewrite (new mtime) is hashed again, alone
    data = path / "target.onnx"
    data.write_bytes(data.read_bytes())
    assert check_files(path, files, "fix") == ["target.onnx"]
    assert check_files(path, files, "fix") == []

    # changed bytes with size and mtime restored: the change time tells the fast path, which hashes it alone
    tamper_keeping_stamp(path / "target.onnx.data")
    hashes.clear()
    with pytest.raises(DtrtError) as e:
        load_export(path)
    msg = one_line_error(e)
    assert msg.startswith(f"{path / 'target.onnx.data'}: its sha256 differs from the manifest's")
    assert "dtrt export --model tiny" in msg and msg.endswith("--force`")
    assert hashes == [path / "target.onnx.data"]
    # the failed check recorded nothing: every later load fails the same way, a full check too
    with pytest.raises(DtrtError, match="sha256 differs"):
        load_export(path)
    with pytest.raises(DtrtError, match="sha256 differs"):
        load_export(path, full_check=True)


def test_fast_path_sees_a_file_replaced_by_a_copy_with_its_times(tmp_path, cache, hashes):
    """A file replaced by another with the same size and timestamps (`cp -p`, an rsync) has another inode: hashed."""
    path = small_export(tmp_path / "exp")
    files = json.loads((path / MANIFEST).read_text())["files"]
    load_export(path)
    data = path / "target.onnx.data"
    other = tmp_path / "other"
    other.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))
    shutil.copystat(data, other)
    other.replace(data)
    hashes.clear()
    with pytest.raises(DtrtError, match="sha256 differs"):
        check_files(path, files, "fix")
    assert hashes == [data]


def test_size_and_missing_files(tmp_path, cache):
    path = small_export(tmp_path / "exp")
    load_export(path)
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(DtrtError, match=r"tokenizer\.json: 2 bytes, the manifest records 13 \(truncated or modified\)"):
        load_export(path)
    (path / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(DtrtError, match=r"tokenizer\.json: missing; re-export with `dtrt export"):
        load_export(path)


def test_dtrt_verify(tmp_path, cache, monkeypatch, capsys):
    path = small_export(tmp_path / "exp")
    files = json.loads((path / MANIFEST).read_text())["files"]
    size = sum(m["size"] for m in files.values())
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(path))
    assert code == 0, err
    assert out == f"{path}: 3 files, {size / 1e6:.1f} MB, every sha256 matches its manifest\n" and err == ""
    assert verify_dir(path) == (3, size)

    tamper_keeping_stamp(path / "target.onnx.data")
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {path / 'target.onnx.data'}: its sha256 differs")
    assert "--force`" in err

    code, out, err = run_cli(monkeypatch, capsys, "verify", str(tmp_path / "nothing"))
    assert code == 2 and err.count("\n") == 1 and "export directory not found" in err


def test_dtrt_verify_imports_no_torch(tmp_path, cache):
    """`dtrt verify` hashes files: a plain click command, which imports none of the runtime."""
    path = small_export(tmp_path / "exp")
    code = (
        "import sys; from dtrt.cli import cli; cli.main(['verify', sys.argv[1]], standalone_mode=False); "
        "print([m for m in ('torch', 'numpy', 'onnxruntime') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    listed, imported = out.stdout.splitlines()
    assert listed.startswith(f"{path}: 3 files,") and listed.endswith("every sha256 matches its manifest")
    assert imported == "[]"


# the verified state


def test_verified_state_lives_in_the_cache(tmp_path, cache, monkeypatch):
    path = small_export(tmp_path / "exp")
    before = listing(path)
    load_export(path)
    load_export(path, full_check=True)
    load_export(path)
    assert listing(path) == before  # nothing written into the artifact
    states = list((cache / "verified").iterdir())
    assert len(states) == 1 and states[0].suffix == ".json"
    state = json.loads(states[0].read_text())
    assert state["root"] == str(path.resolve())
    assert sorted(state["files"]) == ["target.onnx", "target.onnx.data", "tokenizer/tokenizer.json"]
    # the same directory reached through a relative path shares the state
    monkeypatch.chdir(tmp_path)
    assert check_files(Path("exp"), json.loads((path / MANIFEST).read_text())["files"], "fix") == []


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DTRT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "dtrt"


@pytest.mark.parametrize("where", ["cache is a file", "verified is a file", "state is a directory"])
def test_unwritable_cache_does_not_break_loading(tmp_path, monkeypatch, hashes, where):
    path = small_export(tmp_path / "exp")
    cache = tmp_path / "cache"
    monkeypatch.setenv("DTRT_CACHE", str(cache))
    if where == "cache is a file":
        cache.write_text("not a directory")
    else:
        cache.mkdir()
        if where == "verified is a file":
            (cache / "verified").write_text("not a directory")
        else:
            (cache / "verified").mkdir()
            verify._state_path(path).mkdir()  # neither readable nor replaceable as a file
    load_export(path)
    load_export(path)  # the state could not be recorded: hashed again, still loads
    assert len(hashes) == 6
    tamper_keeping_stamp(path / "target.onnx")
    with pytest.raises(DtrtError, match="sha256 differs"):
        load_export(path)
    if cache.is_dir():  # nothing half-written left behind in the cache
        assert sorted(p.name for p in cache.rglob("*")) == sorted(
            {"cache is a file": [], "verified is a file": ["verified"]}.get(where, ["verified", state_name(path)])
        )


def state_name(path: Path) -> str:
    return verify._state_path(path).name


def test_unreadable_state_is_ignored(tmp_path, cache, hashes):
    path = small_export(tmp_path / "exp")
    load_export(path)
    state = verify._state_path(path)
    for bad in ("{not json", "[1, 2]", json.dumps({"root": "/elsewhere", "files": {}})):
        state.write_text(bad)
        hashes.clear()
        load_export(path)
        assert len(hashes) == 3
    hashes.clear()
    load_export(path)
    assert hashes == []


def test_record_verified_then_first_load_hashes_nothing(tmp_path, cache, hashes):
    """What the producers do: record the table they just hashed, so the first load hashes nothing."""
    path = small_export(tmp_path / "exp")
    record_verified(path, json.loads((path / MANIFEST).read_text())["files"])
    load_export(path)
    assert hashes == []


# engines


def test_engine_plan_with_a_flipped_byte(tmp_path, cache, fake_trt, hashes, monkeypatch, capsys):  # noqa: F811
    export_dir = write_export(tmp_path / "exports" / "tiny")
    eng = build_engines(export_dir, tmp_path / "engines")
    assert not [p for p in hashes if p.is_relative_to(eng.path)]  # the build recorded what it wrote
    before = listing(eng.path)
    plan = eng.path / "target.plan"
    rebuild = f"rebuild with `dtrt build-engine {export_dir.resolve()} --out {tmp_path / 'engines'}"

    tamper_keeping_stamp(plan)
    with pytest.raises(DtrtError, match="sha256 differs"):
        read_engine(eng.path)  # its change time differs from the verified one
    with pytest.raises(DtrtError) as e:
        read_engine(eng.path, full_check=True)
    msg = one_line_error(e)
    assert msg.startswith(f"{plan}: its sha256 differs from the manifest's") and rebuild in msg
    assert msg.endswith("--force`")
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(eng.path))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {plan}: its sha256 differs")

    flip_byte(plan)  # flipped back, then another byte with a later mtime: the fast path hashes it
    flip_byte(plan, 1)
    st = plan.stat()
    os.utime(plan, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(DtrtError) as e:
        read_engine(eng.path)
    msg = one_line_error(e)
    assert msg.startswith(f"{plan}: its sha256 differs") and rebuild in msg
    assert listing(eng.path) == before


def test_verify_a_good_engine(tmp_path, cache, fake_trt, monkeypatch, capsys):  # noqa: F811
    eng = build_engines(write_export(tmp_path / "exports" / "tiny"), tmp_path / "engines")
    files = eng.manifest["files"]
    assert sorted(files) == sorted([*(f"{s}.plan" for s in eng.manifest["stages"]), "timing.cache"])
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(eng.path))
    assert code == 0, err
    size = sum(m["size"] for m in files.values())
    assert out == f"{eng.path}: {len(files)} files, {size / 1e6:.1f} MB, every sha256 matches its manifest\n"


# staging


def staged(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_staging_appears_only_complete(tmp_path):
    out = tmp_path / "parent" / "out"
    with staging(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(f".out.tmp-{H}-{os.getpid()}-")
        (tmp / "a").write_text("a")
        assert not out.exists()
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("b")
        assert not out.exists()
    assert listing(out) == ["a", "sub", "sub/b"]
    assert staged(out.parent) == []


def test_staging_error_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="half way"):
        with staging(out) as tmp:
            (tmp / "a").write_text("a")
            raise RuntimeError("half way")
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyboardInterrupt):
        with staging(out) as tmp:
            (tmp / "a").write_text("a")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_staging_replaces_an_existing_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError):
        with staging(out) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError
    assert listing(out) == ["old"]  # a failed write keeps what was there
    with staging(out) as tmp:
        (tmp / "new").write_text("new")
    assert listing(out) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_staging_replaces_a_file_or_a_symlink_without_leftovers(tmp_path):
    (tmp_path / "file").write_text("a file where the directory goes")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("keep")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for name in ("file", "link", "dangling"):
        with staging(tmp_path / name) as tmp:
            (tmp / "new").write_text("new")
        assert (tmp_path / name).is_dir() and not (tmp_path / name).is_symlink()
        assert listing(tmp_path / name) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "elsewhere", "file", "link"]
    assert listing(target) == ["keep"]  # a symlink is replaced, not what it points to


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_staging_of_a_dead_process_is_removed(tmp_path):
    pid, me = f"{H}-{dead_pid()}", f"{H}-{os.getpid()}"
    for name in ("out", "file", "link"):  # the older copies' destinations exist: the swap finished
        (tmp_path / name).mkdir()
    dead = [tmp_path / f".out.tmp-{pid}-abcd1234", tmp_path / f".other.tmp-{pid}-x", tmp_path / f".out.old-{pid}"]
    live = [tmp_path / f".out.tmp-{me}-keep", tmp_path / f".out.old-{me}"]
    others = [tmp_path / ".out.tmp-notapid", tmp_path / "plain", tmp_path / f".file.tmp-{pid}-x"]
    others.append(tmp_path / f".out.tmp-otherhost-{dead_pid()}-x")  # another machine's writer: not ours to judge
    for d in dead + live + others[:2] + others[3:]:
        d.mkdir()
        (d / "half").write_text("half")
    others[2].write_text("a file, not a staging directory")
    target = tmp_path / "target"  # older copies swapped out by a killed writer: a file, a symlink
    target.mkdir()
    (target / "keep").write_text("keep")
    (tmp_path / f".file.old-{pid}").write_text("an older file")
    (tmp_path / f".link.old-{pid}").symlink_to(target)
    dead += [tmp_path / f".file.old-{pid}", tmp_path / f".link.old-{pid}"]
    others.append(target)

    with staging(tmp_path / "new") as tmp:
        (tmp / "x").write_text("x")
    assert not any(d.exists() or d.is_symlink() for d in dead)
    assert all(d.exists() for d in live + others) and listing(target) == ["keep"]
    assert clear_stale(tmp_path) == [] and clear_stale(tmp_path / "missing") == []


def test_an_older_copy_swapped_out_by_a_killed_writer_is_put_back(tmp_path):
    old = tmp_path / f".out.old-{H}-{dead_pid()}"  # killed after moving `out` aside, before the new one arrived
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    assert clear_stale(tmp_path) == []
    assert not old.exists() and (tmp_path / "out" / "manifest.json").read_text() == "{}"


def child_in_staging(code: str) -> subprocess.Popen:
    """A Python child that runs `code` (which enters a staging block and prints "ready" in it), then sleeps."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    try:
        assert child.stdout.readline().strip() == "ready"
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child


def kill9(child: subprocess.Popen):
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.stdout.close()


def test_killed_writer_leaves_no_output_and_its_leftover_is_removed(tmp_path):
    out = tmp_path / "out"
    child = child_in_staging(
        f"""
        import time
        from pathlib import Path
        from dtrt.artifacts.files import staging
        with staging(Path({str(out)!r})) as tmp:
            (tmp / "part").write_text("half")
            print("ready", flush=True)
            time.sleep(120)
        """
    )
    kill9(child)
    leftovers = staged(tmp_path)
    assert not out.exists() and len(leftovers) == 1 and leftovers[0].startswith(f".out.tmp-{H}-{child.pid}-")
    with staging(out) as tmp:
        (tmp / "whole").write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and listing(out) == ["whole"]


def fake_build(calls):
    def build(path: Path, log=None):
        calls.append(path)
        (path / "weights").write_text("w")
        (path / "README.md").write_text("a finished pair")

    return build


def test_built_once(cache):
    calls = []
    path = built_once("fake-v1", fake_build(calls))
    assert path == cache / "fake-v1" and (path / "README.md").is_file()
    assert len(calls) == 1 and calls[0] != path  # built in a staging directory
    assert built_once("fake-v1", fake_build(calls)) == path and len(calls) == 1

    def failing(path: Path, log=None):
        (path / "README.md").write_text("too early")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError):
        built_once("broken-v1", failing)
    assert sorted(p.name for p in cache.iterdir()) == ["fake-v1"]


def test_killed_build_leaves_nothing_finished_looking(cache):
    child = child_in_staging(
        """
        import time
        from dtrt.zoo.registry import built_once
        def build(path, log=None):
            (path / "README.md").write_text("written first")
            print("ready", flush=True)
            time.sleep(120)
        built_once("fake-v1", build)
        """
    )
    kill9(child)
    assert not (cache / "fake-v1").exists()
    leftovers = staged(cache)
    assert len(leftovers) == 1 and leftovers[0].startswith(f".fake-v1.tmp-{H}-{child.pid}-")
    calls = []
    path = built_once("fake-v1", fake_build(calls))
    assert len(calls) == 1 and (path / "weights").read_text() == "w"
    assert sorted(p.name for p in cache.iterdir()) == ["fake-v1"]


@pytest.mark.parametrize("table", [None, {}, {"target.onnx": {"size": 500}}, ["target.onnx"]])
def test_a_manifest_without_its_file_table_is_refused(tmp_path, cache, monkeypatch, capsys, fake_trt, table):  # noqa: F811
    """A manifest whose file table is missing or malformed would check nothing: refused like a modified file."""
    path = small_export(tmp_path / "exp")
    eng = build_engines(write_export(tmp_path / "exports" / "tiny"), tmp_path / "engines").path
    for art, load, fix in ((path, load_export, "re-export with `dtrt export"), (eng, read_engine, "rebuild with")):
        m = json.loads((art / MANIFEST).read_text())
        m.pop("files")
        if table is not None:
            m["files"] = table
        (art / MANIFEST).write_text(json.dumps(m))
        with pytest.raises(DtrtError) as e:
            load(art)
        msg = one_line_error(e)
        assert msg.startswith(f"{art / MANIFEST}: no table of its files' sizes and sha256") and fix in msg
        code, out, err = run_cli(monkeypatch, capsys, "verify", str(art))
        assert code == 2 and out == "" and err.count("\n") == 1 and "no table of its files'" in err


@pytest.mark.slow
@pytest.mark.slow
def test_export_records_what_it_wrote(tiny, tmp_path, cache, hashes):
    """An export records its files as verified at their final path (as an engine build does, above): its first
    load hashes nothing, and the state is in the cache, not in the export."""
    from dtrt.exporter.export_config import ExportConfig
    from dtrt.exporter.write import export_pair

    exp = export_pair(tiny, tmp_path / "exp", ExportConfig(max_context=64, drafters=("dflash",)), model="tiny")
    assert hashes == []
    assert load_export(exp.path).manifest == exp.manifest and hashes == []
    assert MANIFEST in listing(exp.path) and not [n for n in listing(exp.path) if "verified" in n or ".tmp" in n]
    assert json.loads(verify._state_path(exp.path).read_text())["root"] == str(exp.path.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "exp"]  # no staging leftovers

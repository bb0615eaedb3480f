"""Checkpoint loading: released layouts (single file and shards), config keys, and one-line errors."""

import json

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
from dtrt.zoo.registry import find_local, resolve


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

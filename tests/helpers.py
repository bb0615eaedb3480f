"""Small random checkpoints in the released layouts, written with the real writers and read with the real loaders."""
import json
import sys
from pathlib import Path

import torch

from dtrt.models.checkpoint import drafter_state, save_checkpoint
from dtrt.models.config import DrafterConfig
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter


def drafter_json(hidden=64, vocab=100, layers=1, taps=(0, 1), block=8, domino=False, **dflash):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "block_size": block, "num_target_layers": 3,
           "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": list(taps), **dflash}}
    if domino:
        cfg["dflash_config"].update(projector_type="domino", shift_label=True, pure_draft_prefix_len=1)
    return cfg


def write_drafter(path: Path, cfg_json: dict, gru=16, emb=24, head=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_json))
    cfg = DrafterConfig.from_json(path / "config.json")
    has_head = cfg_json["dflash_config"].get("projector_type") is not None if head is None else head
    model = Drafter(cfg, DominoHead(cfg.hidden_size, gru, emb, cfg.vocab_size) if has_head else None)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_checkpoint(path, cfg_json, drafter_state(model))
    return path


def run_cli(monkeypatch, capsys, *args):
    """`dtrt ARGS` in-process: (exit code, stdout, stderr)."""
    from dtrt import cli

    monkeypatch.setattr(sys, "argv", ["dtrt", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err

"""Small random checkpoints in the released layouts, written with the real writers and read with the real loaders."""

import sys
from dataclasses import replace
from pathlib import Path

import torch

from dtrt.launch import open_sources
from dtrt.models.checkpoint import drafter_state, save_checkpoint
from dtrt.models.config import DrafterConfig
from dtrt.models.domino import HEAD_MODULES, DominoHead
from dtrt.models.drafter import Drafter
from dtrt.runtime.pipeline import open_pipeline
from dtrt.runtime.spec import RunSpec

PROMPTS = ["The cat sees ", "A quick fox ", "Every king walks ", "The moon is very ", "Some old man reads "]


def generate_all(pipe, max_new=64):
    """The pipeline's greedy generations of PROMPTS."""
    from dtrt.runtime.sampling import SamplingConfig

    ids = [pipe.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return [pipe.generate(i, max_new, SamplingConfig()) for i in ids]


def spec(method: str = "dominotree", **fields) -> RunSpec:
    """A RunSpec for `method` (tests name the method first, as the CLI's --method)."""
    return RunSpec(method=method, **fields)


def pipe_for(
    pair, run: RunSpec, *, dtype=None, backend="torch", export=None, engines=None, threads=None, model=None, device=None
):
    """The pipeline of `run` on `backend` over the checkpoints `pair` (or an export alone), through the same
    open_sources and open_pipeline as the front ends."""
    run = replace(
        run,
        backend=backend,
        export=Path(export) if export is not None else None,
        engines=Path(engines) if engines is not None else None,
        threads=threads,
        dtype=dtype,
        model=model,
        device=device or "cpu",
    )
    return open_pipeline(run, open_sources(run, pair=pair))


def drafter_json(hidden=64, vocab=100, layers=1, taps=(0, 1), block=8, domino=False, **dflash):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "block_size": block,
        "num_target_layers": 3,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": list(taps), **dflash},
    }
    if domino:
        cfg["dflash_config"].update(projector_type="domino", shift_label=True, pure_draft_prefix_len=1)
    return cfg


def write_drafter(path: Path, cfg_json: dict, gru=16, emb=24, head=None, head_prefix="", seed=None):
    """A random drafter written with `cfg_json` as its config.json (as given, even without the keys a loader needs:
    the tensors' shapes do not depend on shift_label), its Domino head's tensors under `head_prefix` (one of
    dtrt.models.domino.HEAD_PREFIXES)."""
    path.mkdir(parents=True, exist_ok=True)
    dcfg = cfg_json["dflash_config"]
    cfg = DrafterConfig.from_dict(cfg_json | {"dflash_config": dcfg | {"shift_label": False}})
    has_head = dcfg.get("projector_type") is not None if head is None else head
    model = Drafter(cfg, DominoHead(cfg.hidden_size, gru, emb, cfg.vocab_size) if has_head else None)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for p in model.parameters():
        p.data.normal_(0, 0.1, generator=gen)
    state = drafter_state(model)
    save_checkpoint(
        path, cfg_json, {(head_prefix + k if k.startswith(HEAD_MODULES) else k): v for k, v in state.items()}
    )
    return path


def small_disk(monkeypatch, free: int):
    """Every disk dtrt asks about has `free` bytes free."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr("dtrt.artifacts.files.shutil.disk_usage", lambda p: real(p)._replace(free=free))


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


# host synchronizations (and the ways Python reads a device value back) that fixed-shape GPU code must not do
FORBIDDEN = [
    (torch.Tensor, name)
    for name in ("item", "tolist", "numpy", "nonzero", "masked_select", "__bool__", "__int__", "__float__", "__index__")
]
FORBIDDEN += [(torch, name) for name in ("nonzero", "masked_select", "argwhere")]


def _raise(*args, **kwargs):
    raise AssertionError("host synchronization")


def _no_bool_index(orig):
    def indexed(self, index, *rest):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise AssertionError("boolean-mask indexing")
        return orig(self, index, *rest)

    return indexed


def no_host_sync(mp):
    """Make every FORBIDDEN call and boolean-mask indexing raise, within monkeypatch context `mp`; checks that
    the guard is live."""
    import pytest

    for owner, name in FORBIDDEN:
        mp.setattr(owner, name, _raise)
    mp.setattr(torch.Tensor, "__getitem__", _no_bool_index(torch.Tensor.__getitem__))
    mp.setattr(torch.Tensor, "__setitem__", _no_bool_index(torch.Tensor.__setitem__))
    with pytest.raises(AssertionError):
        torch.ones(1).item()
    with pytest.raises(AssertionError):
        torch.ones(2)[torch.ones(2, dtype=torch.bool)]


def drafter_quant_export(exp, tmp_path_factory, quant: str):
    """A copy of the export `exp` with its drafters' stages quantized as `dtrt export --drafter-quant <quant>` does
    (the same `quantize_drafter` on the exported files), without exporting the target again."""
    import json
    import shutil

    from dtrt.artifacts.export import load_export
    from dtrt.artifacts.files import MANIFEST, write_manifest
    from dtrt.exporter.quantize import quantize_drafter, quantized_stages

    path = tmp_path_factory.mktemp("export") / f"{exp.path.name}-{quant}"
    shutil.copytree(exp.path, path)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["drafter_quant"] = quant
    manifest["quantized_stages"] = quantized_stages(manifest["stages"], quant)
    for name in manifest["quantized_stages"]:
        quantize_drafter(path / manifest["stages"][name]["file"], name, quant)
    write_manifest(path, manifest)
    return load_export(path)

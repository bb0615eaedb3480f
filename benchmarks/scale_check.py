"""The Qwen3 path at real shapes on this machine: random checkpoints written in the released layouts (Qwen/Qwen3-*,
z-lab/*-DFlash-b16, Huang2020/*-Domino-b16) at a real config, then every step a user takes, each in a fresh
process so its time and peak resident memory are its own:

    write       the target, DFlash and Domino checkpoints, tensor by tensor, in bf16 (the released dtype)
    export      dtrt export --dtype DTYPE [--quant QUANT] of the target and the Domino drafter (which serves every
                method), its size on disk and how many copies of the [vocab, hidden] embedding it stores
    sessions    ONNX Runtime CPU sessions of the target and every DominoTree stage, resident memory
    ar          dtrt run --method ar, a few tokens, on the export
    dominotree  dtrt run --method dominotree, a few tokens, on the export
    parity      dtrt parity --random-only --quick (one random case per stage)

A step killed for memory (or failing) is reported as such, and the next ones still run. Needs Qwen3's tokenizer
(DTRT_QWEN3_TOKENIZER: a directory with tokenizer.json and tokenizer_config.json; see .ci/run).

    python benchmarks/scale_check.py --config qwen3-1.7b --dtype fp16 --dir /tmp/scale
    python benchmarks/scale_check.py --config qwen3-4b --dtype fp16 --dir /tmp/scale --json scale-4b.json
    python benchmarks/scale_check.py --config qwen3-4b --dtype fp16 --quant int8 --dir /tmp/scale \
        --steps export,sessions,ar,dominotree,parity

Each quantization exports to its own directory under --dir (export, export-int8, export-int4), next to the
checkpoints the write step made.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Qwen3 configs as released (config.json), and the DFlash/Domino b16 drafters' shapes (5 layers, 5 taps)
CONFIGS = {
    "qwen3-small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "heads": 4, "kv": 2},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "heads": 16, "kv": 8},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "heads": 32, "kv": 8},
}
VOCAB, MASK, HEAD_DIM, DRAFT_LAYERS, GRU, EMB = 151936, 151669, 128, 5, 1024, 256
SHARD_BYTES = 2 << 30
STEPS = ("write", "export", "sessions", "ar", "dominotree", "parity")


def taps(layers: int, n: int = DRAFT_LAYERS) -> list[int]:
    return [round(1 + i * (layers - 4) / (n - 1)) for i in range(n)]


def target_config(c: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv"],
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


def drafter_config(c: dict, domino: bool) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": DRAFT_LAYERS,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "block_size": 16,
        "num_target_layers": c["num_hidden_layers"],
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": taps(c["num_hidden_layers"])},
    }
    if domino:
        cfg["dflash_config"].update(
            projector_type="domino", gru_hidden_dim=GRU, emb_dim=EMB, pure_draft_prefix_len=1, shift_label=True
        )
    return cfg


def layer_tensors(prefix: str, h: int, i: int, heads: int, kv: int):
    """A Qwen3 decoder layer's tensors (the target's and the drafters' are the same layout)."""
    q, k = heads * HEAD_DIM, kv * HEAD_DIM
    yield from (
        (prefix + "input_layernorm.weight", (h,)),
        (prefix + "post_attention_layernorm.weight", (h,)),
        (prefix + "self_attn.q_proj.weight", (q, h)),
        (prefix + "self_attn.k_proj.weight", (k, h)),
        (prefix + "self_attn.v_proj.weight", (k, h)),
        (prefix + "self_attn.o_proj.weight", (h, q)),
        (prefix + "self_attn.q_norm.weight", (HEAD_DIM,)),
        (prefix + "self_attn.k_norm.weight", (HEAD_DIM,)),
        (prefix + "mlp.gate_proj.weight", (i, h)),
        (prefix + "mlp.up_proj.weight", (i, h)),
        (prefix + "mlp.down_proj.weight", (h, i)),
    )


def target_tensors(c: dict):
    h, i = c["hidden_size"], c["intermediate_size"]
    yield "model.embed_tokens.weight", (VOCAB, h)
    for n in range(c["num_hidden_layers"]):
        yield from layer_tensors(f"model.layers.{n}.", h, i, c["heads"], c["kv"])
    yield "model.norm.weight", (h,)


def drafter_tensors(c: dict, domino: bool):
    h, i = c["hidden_size"], c["intermediate_size"]
    yield "fc.weight", (h, DRAFT_LAYERS * h)
    yield "hidden_norm.weight", (h,)
    for n in range(DRAFT_LAYERS):
        yield from layer_tensors(f"layers.{n}.", h, i, 32, 8)
    yield "norm.weight", (h,)
    if domino:
        yield "prefix_gru.weight_ih_l0", (3 * GRU, h)
        yield "prefix_gru.weight_hh_l0", (3 * GRU, GRU)
        yield "embed_proj.0.weight", (EMB, h + GRU)
        yield "embed_proj.2.weight", (VOCAB, EMB)


def write_checkpoint(path: Path, config: dict, tensors, seed: int):
    """config.json and bf16 safetensors shards written a shard at a time (never the whole model in memory)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)
    shards, shard, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            shards.append(name)
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    for name, shape in tensors:
        if len(shape) == 1:  # norms: ones, as trained models have them near
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    if len(shards) == 1:
        (path / shards[0]).rename(path / "model.safetensors")
    else:
        index = {"metadata": {"total_size": sum((path / s).stat().st_size for s in shards)}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def step_write(args):
    c = CONFIGS[args.config]
    root = Path(args.dir)
    tok = Path(os.environ["DTRT_QWEN3_TOKENIZER"])
    write_checkpoint(root / "target", target_config(c), target_tensors(c), 0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tok / name, root / "target" / name)
    gen_cfg = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (root / "target" / "generation_config.json").write_text(json.dumps(gen_cfg))
    write_checkpoint(root / "dflash", drafter_config(c, False), drafter_tensors(c, False), 1)
    write_checkpoint(root / "domino", drafter_config(c, True), drafter_tensors(c, True), 2)
    return {"checkpoints_gb": du(root) / 1e9}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def dtrt(*argv: str):
    from dtrt.cli import main

    sys.argv = ["dtrt", *argv]
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise


def export_dir(args) -> Path:
    return Path(args.dir) / ("export" if args.quant == "none" else f"export-{args.quant}")


def step_export(args):
    root, out = Path(args.dir), export_dir(args)
    target, domino = str(root / "target"), str(root / "domino")
    dtrt("export", "--target", target, "--drafter", domino, "--out", str(out), "--dtype", args.dtype,
         "--quant", args.quant, "--max-context", "1024", "--force")  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    return {"export_gb": du(out) / 1e9, "embedding_copies": embedding_copies(out, manifest)}


def embedding_copies(out: Path, manifest: dict) -> int:
    """How many [vocab, hidden] tensors the export stores (distinct byte ranges of its weight files)."""
    import onnx

    hidden = manifest["target"]["hidden_size"]
    seen = set()
    for meta in manifest["stages"].values():
        for init in onnx.load(str(out / meta["file"]), load_external_data=False).graph.initializer:
            info = {e.key: e.value for e in init.external_data}
            if info and sorted(init.dims) == sorted([VOCAB, hidden]):
                seen.add((info["location"], info.get("offset", "0")))
    return len(seen)


def rss_now() -> dict:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, *rest = line.split()
        if key.rstrip(":") in ("Rss", "Pss", "Anonymous"):
            out[key.rstrip(":").lower() + "_gb"] = int(rest[0]) * 1024 / 1e9
    return out


def step_sessions(args):
    from dtrt.artifacts.export import load_export
    from dtrt.runtime.backends.onnxruntime import OrtBackend
    from dtrt.runtime.spec import RunSpec

    exp = load_export(export_dir(args))
    before = rss_now()
    backend = OrtBackend(exp, "domino", threads=2)
    backend.prepare(RunSpec(method="dominotree", builder="frontier", budget=exp.manifest["budget"]))
    after = rss_now()
    return {k: after[k] - before[k] for k in after}


def step_generate(args, method: str):
    dtrt("run", "--export", str(export_dir(args)), "--method", method, "--max-new-tokens", "8",
         "--no-chat", "--json", "--threads", "2", "The history of science")  # fmt: skip
    return {}


def step_parity(args):
    dtrt("parity", str(export_dir(args)), "--random-only", "--quick")
    return {}


def run_step(args, step: str) -> dict:
    """`step` in a child process: its result, wall time and peak resident memory, or how it failed."""
    t0 = time.perf_counter()
    flags = {"--config": args.config, "--dtype": args.dtype, "--quant": args.quant, "--dir": args.dir, "--step": step}
    child = subprocess.run(
        [sys.executable, __file__, *(x for pair in flags.items() for x in pair)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # GB (Linux: KiB); children's max so far
    out = {"step": step, "wall_s": round(wall, 1), "peak_rss_gb_so_far": round(peak, 2)}
    if child.returncode == 0:
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {}
        out.update(ok=True, **result)
    else:
        killed = child.returncode < 0
        why = f"killed by signal {-child.returncode}" if killed else (child.stderr.strip().splitlines() or ["?"])[-1]
        out.update(ok=False, why=why)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=list(CONFIGS), default="qwen3-1.7b")
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp16")
    ap.add_argument("--quant", choices=["none", "int8", "int4"], default="none", help="the target's weights")
    ap.add_argument("--dir", required=True, help="working directory (checkpoints and export; can take 20 GB)")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:  # one step, in this (child) process
        fn = {
            "write": step_write,
            "export": step_export,
            "sessions": step_sessions,
            "ar": lambda a: step_generate(a, "ar"),
            "dominotree": lambda a: step_generate(a, "dominotree"),
            "parity": step_parity,
        }[args.step]
        result = fn(args)
        result["self_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print("RESULT " + json.dumps(result))
        return
    if "DTRT_QWEN3_TOKENIZER" not in os.environ:
        raise SystemExit("error: set DTRT_QWEN3_TOKENIZER to a directory with Qwen3's tokenizer.json (see .ci/run)")
    rows = [run_step(args, s) for s in args.steps.split(",")]
    print(f"\n{args.config}, export dtype {args.dtype}, quant {args.quant}, machine memory {total_gb():.1f} GB\n")
    print("| step | ok | wall s | peak RSS GB | notes |")
    print("|---|---|---:|---:|---|")
    for r in rows:
        notes = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("step", "ok", "wall_s", "peak_rss_gb_so_far", "self_peak_rss_gb", "why")}  # fmt: skip
        peak = r.get("self_peak_rss_gb", float("nan"))
        print(f"| {r['step']} | {'yes' if r['ok'] else 'no: ' + r['why']} | {r['wall_s']} | {peak:.2f} | {notes} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


def total_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


if __name__ == "__main__":
    main()

"""What the training call needs, in one folder: the target (its compact weights, or for a pair without a GGUF
source its checkpoint as it is), the drafter data, the drafter the run starts from, the corpus text, the held-out
prompts and the run's settings (`run.json`)."""

import json
import shutil
from pathlib import Path

import target_codec

from dtrt.artifacts.files import sha256

# the settings of the shipped SmolLM2 drafter's last run (dtrt/assets/smollm2-135m/TRAINING.md), on all windows
SMOLLM2 = {
    "config": {
        "lr": 5e-4,
        "seed": 3,
        "data_rows": 1_000_000,
        "corpus_rows": 600,
        "eval_prompts": 10,
        "eval_tokens": 48,
        "feature_batch": 64,
        "anchors": 8,
    },
    "corpus_chars": 1_000_000,
    "probe_batches": [16, 32, 64, 128],
}
TINY = {
    "config": {
        "seq_len": 64,
        "anchors": 4,
        "lr": 3e-3,
        "eval_prompts": 2,
        "eval_tokens": 12,
        "corpus_rows": 24,
        "data_rows": 1_000_000,
        "candidates": 48,
        "feature_batch": 8,
    },
    "corpus_chars": 20_000,
    "probe_batches": [2, 4, 8],
}


TINY_HELD_OUT = {"a": ["The cat sees ", "A quick fox "], "b": ["The moon is very ", "One happy child "]}


def build(
    out: Path,
    *,
    target: Path,
    gguf: Path | None,
    data: list[Path],
    drafter: Path,
    corpus: list[Path],
    held_out: dict[str, list[str]],
    settings: dict,
) -> dict:
    """`out`/ as the training call reads it; returns run.json."""
    from dtrt.train.data import read_corpus

    out = build_pair(out, target=target, gguf=gguf, drafter=drafter, held_out=held_out)
    for d in data:
        shutil.copytree(d, out / "data" / d.name, ignore=shutil.ignore_patterns(".lock", "*.tmp*"))
    text = read_corpus(corpus, settings["corpus_chars"])
    (out / "corpus.txt").write_text(text)
    spec = {
        "config": {**settings["config"], **shape_of(drafter), "corpus_chars": len(text)},
        "data": [f"data/{d.name}" for d in data],
        "held_out": [f"held-out/{name}.jsonl" for name in held_out],
        "probe_batches": settings["probe_batches"],
    }
    (out / "run.json").write_text(json.dumps(spec, indent=1) + "\n")
    return spec


def build_pair(out: Path, *, target: Path, gguf: Path | None, drafter: Path, held_out: dict[str, list[str]]) -> Path:
    """`out`/ with what a measurement needs of the pair: the target (its compact weights, or the checkpoint as it
    is), the drafter and the held-out prompts (a JSONL file a set, `dtrt bench --datasets` reads them)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if gguf:
        target_codec.encode(target, gguf, out / "target")
    else:
        shutil.copytree(target, out / "target")
        record = {"model.safetensors": sha256(target / "model.safetensors")}
        (out / "target" / target_codec.FINGERPRINT).write_text(json.dumps(record) + "\n")
    shutil.copytree(drafter, out / "drafter")
    (out / "held-out").mkdir()
    for name, texts in held_out.items():
        (out / "held-out" / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return out


def shape_of(drafter: Path) -> dict:
    """The train-drafter flags that must match the drafter a run starts from."""
    cfg = json.loads((Path(drafter) / "config.json").read_text())
    head = cfg["dflash_config"]
    return {
        "layers": cfg["num_hidden_layers"],
        "block_size": cfg["block_size"],
        "gru_dim": head["gru_hidden_dim"],
        "emb_dim": head["emb_dim"],
    }


def restore_target(stage: Path, into: Path) -> Path:
    """The target checkpoint the run trains against, rebuilt (or copied) into `into` and checked by sha256."""
    stage, into = Path(stage) / "target", Path(into)
    if (stage / target_codec.WEIGHTS).is_file():
        return target_codec.decode(stage, into)
    want = json.loads((stage / target_codec.FINGERPRINT).read_text())["model.safetensors"]
    if sha256(stage / "model.safetensors") != want:
        raise target_codec.CodecError(f"{stage / 'model.safetensors'}: not the staged target (sha256)")
    shutil.copytree(stage, into, dirs_exist_ok=True)
    return into

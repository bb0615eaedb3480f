"""Named model pairs. Released checkpoints are resolved from a local directory or the local Hugging Face cache,
never downloaded; `tiny` is created on first use and cached."""

import os
from dataclasses import dataclass
from pathlib import Path

from dtrt.errors import DtrtError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    target: str  # Hugging Face ids
    dflash: str | None
    domino: str | None
    hidden_size: int
    vocab_size: int
    num_layers: int


REGISTRY = {
    "qwen3-4b": ModelSpec(
        "qwen3-4b", "Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", "Huang2020/Qwen3-4B-Domino-b16", 2560, 151936, 36
    ),
    "qwen3-8b": ModelSpec(
        "qwen3-8b", "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "Huang2020/Qwen3-8B-Domino-b16", 4096, 151936, 36
    ),
}
LOCAL = ("tiny", "tiny-hybrid", "smollm2-135m")


@dataclass
class Pair:
    """Checkpoint directories of a target and its drafters; the tokenizer lives with the target."""

    target: Path
    dflash: Path | None = None
    domino: Path | None = None
    missing_drafter: str | None = None  # why a named pair lacks a drafter and how to get one ({kind}, {dir})

    def drafter_for(self, needs_head: bool) -> Path | None:
        path = (self.domino or None) if needs_head else (self.dflash or self.domino)
        if path is None and self.missing_drafter:
            kind, folder = ("Domino", "domino") if needs_head else ("DFlash", "dflash")
            raise DtrtError(self.missing_drafter.replace("{kind}", kind).replace("{dir}", folder))
        return path


def names() -> list[str]:
    return [*REGISTRY, *LOCAL]


def cache_dir() -> Path:
    return Path(os.environ.get("DTRT_CACHE", Path.home() / ".cache" / "dtrt"))


def hf_hub_cache() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def find_local(repo_id: str, model_dir: Path | None = None) -> Path | None:
    """A directory with config.json for `repo_id`: under model_dir (Name, Org/Name or Org--Name), else the
    Hugging Face cache snapshot that refs/main points to (or the newest snapshot)."""
    org, name = repo_id.split("/")
    if model_dir is not None:
        for cand in (model_dir / name, model_dir / org / name, model_dir / f"{org}--{name}"):
            if (cand / "config.json").is_file():
                return cand
    repo = hf_hub_cache() / f"models--{org}--{name}"
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snaps / ref.read_text().strip() / "config.json").is_file():
        return snaps / ref.read_text().strip()
    if snaps.is_dir():
        found = sorted((p for p in snaps.iterdir() if (p / "config.json").is_file()), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def resolve(name: str, model_dir: Path | None = None, log=None) -> Pair:
    if name == "tiny":
        return tiny_pair(log)
    if name == "tiny-hybrid":
        return tiny_hybrid_pair(log)
    if name == "smollm2-135m":
        from dtrt.models import smollm2

        return smollm2.pair(cache_dir(), log)
    if name not in REGISTRY:
        raise DtrtError(
            f"--model {name!r}: unknown model; known: {', '.join(names())} (or pass --target DIR --drafter DIR)"
        )
    spec = REGISTRY[name]
    model_dir = model_dir or (Path(os.environ["DTRT_MODEL_DIR"]) if "DTRT_MODEL_DIR" in os.environ else None)
    target = find_local(spec.target, model_dir)
    if target is None:
        where = f"{model_dir} or " if model_dir else ""
        raise DtrtError(
            f"--model {name}: {spec.target} not found in {where}{hf_hub_cache()}; download it on a "
            f"machine with network (huggingface-cli download {spec.target}) and pass --model-dir"
        )
    return Pair(target, find_local(spec.dflash, model_dir), find_local(spec.domino, model_dir))


def _built_once(name: str, build, log=None) -> Path:
    """<cache>/<name>, made by build(path) on first use (a finished pair has a README.md)."""
    path = cache_dir() / name
    if not (path / "README.md").is_file():
        if log:
            log(f"creating the {name.rsplit('-v', 1)[0]} pair in {path} (once, about a minute)")
        path.parent.mkdir(parents=True, exist_ok=True)
        build(path, log=log)
    return path


def tiny_pair(log=None) -> Pair:
    from dtrt.models import tiny

    path = _built_once(f"tiny-v{tiny.TINY_VERSION}", tiny.build, log)
    return Pair(path / "target", path / "dflash", path / "domino")


def tiny_hybrid_pair(log=None) -> Pair:
    """The tiny hybrid (Gated-DeltaNet) target with a Domino drafter, which also serves the DFlash methods."""
    from dtrt.models import tiny_hybrid

    path = _built_once(f"tiny-hybrid-v{tiny_hybrid.TINY_HYBRID_VERSION}", tiny_hybrid.build, log)
    return Pair(path / "target", None, path / "domino")

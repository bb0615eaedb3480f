"""The engine directory contract (DESIGN.md section 6): one plan per stage, the timing cache and
manifest.json, checked against the machine before any plan is deserialized."""

import json
from dataclasses import dataclass
from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.export import Export, load_export, read_manifest
from dtrt.artifacts.files import MANIFEST, sha256
from dtrt.artifacts.gpu import LABELS, Machine
from dtrt.artifacts.verify import check_files
from dtrt.errors import DtrtError

FORMAT = "dtrt-engine"
TIMING_CACHE = "timing.cache"


@dataclass
class Engine:
    path: Path
    manifest: dict

    def plan(self, stage: str) -> Path:
        return self.path / self.manifest["stages"][stage]["plan"]

    @property
    def root(self) -> Path:
        """The directory given to `dtrt build-engine --out` (above the machine key)."""
        return self.path.parent.parent

    @property
    def export_path(self) -> Path:
        return Path(self.manifest["export"]["path"])

    def rebuild_hint(self) -> str:
        b = self.manifest.get("build", {})
        flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in b.items() if v is not None)
        return f"dtrt build-engine {self.export_path} --out {self.root}{flags} --force"


def export_digest(exp: Export) -> str:
    return sha256(exp.path / MANIFEST)


def read_engine(path, full_check: bool = False) -> Engine:
    """Read an engine directory's manifest and check its files against it (as load_export does)."""
    path = Path(path)
    build = "build it with `dtrt build-engine EXPORT_DIR --out DIR`"
    manifest = read_manifest(path, FORMAT, "a dtrt engine directory", build)
    eng = Engine(path, manifest)
    if manifest.get("dtrt_version") != __version__:
        raise DtrtError(
            f"{path / MANIFEST}: written by dtrt {manifest.get('dtrt_version')}, this is dtrt {__version__}; "
            f"rebuild with `{eng.rebuild_hint()}`"
        )
    check_files(path, manifest.get("files"), f"rebuild with `{eng.rebuild_hint()}`", full=full_check)
    return eng


def check_engine(eng: Engine, machine: Machine, plugins_sha256: str) -> Export:
    """The engine must be built on this machine's GPU, TensorRT and CUDA, with this dtrt's plugin kernels,
    from its export as it is now; returns that export."""
    mpath = eng.path / MANIFEST
    built = eng.manifest["machine"]
    for field, here in machine.to_json().items():
        if built.get(field) != here:
            raise DtrtError(
                f"{mpath}: {field} {built.get(field)!r} differs from this machine's {here!r} "
                f"(the plans only run on the {LABELS[field]} they were built for); "
                f"rebuild with `{eng.rebuild_hint()}`"
            )
    if eng.manifest["plugins"]["sha256"] != plugins_sha256:
        raise DtrtError(
            f"{mpath}: plugins.sha256 differs from this dtrt's plugin kernels (they changed since the "
            f"build); rebuild with `{eng.rebuild_hint()}`"
        )
    if not (eng.export_path / MANIFEST).is_file():
        raise DtrtError(
            f"{eng.export_path}: the export these engines were built from is missing (the runtime reads "
            f"its manifest and tokenizer); restore it, or export again and rebuild with "
            f"`{eng.rebuild_hint()}`"
        )
    exp = load_export(eng.export_path)
    if export_digest(exp) != eng.manifest["export"]["manifest_sha256"]:
        raise DtrtError(
            f"{mpath}: built from another export than {exp.path} holds now (it was re-exported); "
            f"rebuild with `{eng.rebuild_hint()}`"
        )
    return exp


def peek_engine_export(path) -> Path | None:
    """The export that an engine directory, or a `dtrt build-engine --out` root holding one engine directory, was
    built from, as its manifest records it, read without any check (for a run's defaults: dtrt.launch.resolve_spec);
    None where there is no one such manifest to read (open_engine then says why)."""
    path = Path(path)
    found = [path / MANIFEST] if (path / MANIFEST).is_file() else sorted(path.glob(f"*/*/{MANIFEST}"))
    if len(found) != 1:
        return None
    try:
        return Path(json.loads(found[0].read_text())["export"]["path"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def resolve_engine_dir(path, machine: Machine, model: str | None = None) -> Path:
    """`path` is an engine directory, or the root given to `dtrt build-engine --out`: then this machine's
    key directory and the model's (or the only one) below it."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    keyed = path / machine.key
    if not keyed.is_dir():
        have = sorted(p.name for p in path.iterdir() if p.is_dir()) if path.is_dir() else []
        others = f" (it has engines for: {', '.join(have)})" if have else ""
        raise DtrtError(
            f"{path}: no engines for this machine ({machine.key}){others}; build them with "
            f"`dtrt build-engine EXPORT_DIR --out {path}`"
        )
    models = sorted(p.name for p in keyed.iterdir() if (p / MANIFEST).is_file())
    if model is not None and model in models:
        return keyed / model
    if model is None and len(models) == 1:
        return keyed / models[0]
    if not models:
        raise DtrtError(
            f"{keyed}: holds no engine directory; build one with `dtrt build-engine EXPORT_DIR --out {path}`"
        )
    raise DtrtError(
        f"{keyed}: holds engines for {', '.join(models)}; pass --engines {keyed}/NAME"
        + (f" (none is for {model!r})" if model else "")
    )


def open_engine(path, model: str | None = None) -> tuple[Engine, Export]:
    """The engine directory at `path` (or this machine's under the root `path`), checked against this machine,
    this dtrt's plugin kernels and its export; returns it with the export."""
    from dtrt.artifacts.gpu import probe_machine
    from dtrt.plugins import sources_sha256

    machine = probe_machine("--backend tensorrt")
    engine = read_engine(resolve_engine_dir(path, machine, model))
    return engine, check_engine(engine, machine, sources_sha256())

"""The export directory contract: `manifest.json` next to one ONNX file per stage, checked on every load."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dtrt import __version__
from dtrt.errors import DtrtError

FORMAT = "dtrt-export"
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_hashes(path: Path) -> dict[str, str]:
    """sha256 of config.json and every safetensors file (and index) of a checkpoint directory."""
    names = sorted(p.name for p in path.iterdir() if p.name == "config.json" or ".safetensors" in p.name)
    return {n: sha256(path / n) for n in names}


@dataclass
class Export:
    path: Path
    manifest: dict

    def stage(self, name: str) -> Path:
        return self.path / self.manifest["stages"][name]["file"]

    @property
    def drafters(self) -> dict:
        return self.manifest.get("drafters", {})

    def fix_hint(self, **changes) -> str:
        """The `dtrt export` command that rewrites this export with its recorded flags (and any `changes`)."""
        m = self.manifest
        src = m.get("source", {})
        how = f"--model {src['model']}" if src.get("model") else "--target DIR --drafter DIR"
        flags = {
            "dtype": m.get("dtype"),
            "max_context": m.get("max_context"),
            "budget": m.get("budget"),
            "topm": m.get("topm"),
            "node_topk": m.get("node_topk"),
            "drafter_quant": None if m.get("drafter_quant", "none") == "none" else m["drafter_quant"],
        } | changes
        opts = "".join(f" --{k.replace('_', '-')} {v}" for k, v in flags.items() if v is not None)
        return f"dtrt export {how}{opts} --out {self.path} --force"


def load_export(path, verify_hashes: bool = False) -> Export:
    """Read and check an export directory: manifest present and from this dtrt, every file present with its
    recorded size (and sha256 when asked). Errors name the file and the command that fixes it."""
    path = Path(path)
    mpath = path / MANIFEST
    rerun = f"re-export it with `dtrt export ... --out {path} --force`"
    if not path.is_dir():
        raise DtrtError(f"{path}: export directory not found; create it with `dtrt export --model NAME --out {path}`")
    if not mpath.is_file():
        raise DtrtError(f"{mpath}: not found, so {path} is not a complete dtrt export; {rerun}")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DtrtError(f"{mpath}: not valid JSON ({e.__class__.__name__}); {rerun}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DtrtError(f"{mpath}: not a dtrt export manifest; {rerun}")
    exp = Export(path, manifest)
    if manifest.get("dtrt_version") != __version__:
        raise DtrtError(
            f"{mpath}: written by dtrt {manifest.get('dtrt_version')}, this is dtrt {__version__}; "
            f"re-export with `{exp.fix_hint()}`"
        )
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise DtrtError(f"{f}: missing from the export; re-export with `{exp.fix_hint()}`")
        if f.stat().st_size != meta["size"]:
            raise DtrtError(
                f"{f}: {f.stat().st_size} bytes, the manifest records {meta['size']} (truncated or "
                f"modified); re-export with `{exp.fix_hint()}`"
            )
        if verify_hashes and sha256(f) != meta["sha256"]:
            raise DtrtError(f"{f}: sha256 differs from the manifest (modified); re-export with `{exp.fix_hint()}`")
    return exp


def check_source(exp: Export, target: Path, model: str | None = None, drafters: dict | None = None):
    """An export used together with checkpoints (parity, --model with --export) must come from them: the
    model name, and the sha256 of the target's (and the drafters', kind -> path) config and weights."""
    src = exp.manifest["source"]
    mpath = exp.path / MANIFEST
    if model is not None and src.get("model") not in (None, model):
        raise DtrtError(
            f"{mpath}: exported from model {src['model']!r}, not {model!r}; "
            f"use another --export or run `dtrt export --model {model} --out DIR`"
        )
    checks = [("target", Path(target), src["target_hashes"])]
    checks += [
        (f"{kind} drafter", Path(p), src["drafters"][kind]["hashes"])
        for kind, p in (drafters or {}).items()
        if kind in src["drafters"]
    ]
    for what, path, hashes in checks:
        if not path.is_dir():
            raise DtrtError(
                f"{path}: the {what} checkpoint this export was made from is not found; "
                f"restore it or re-export with `{exp.fix_hint()}`"
            )
        if checkpoint_hashes(path) != hashes:
            raise DtrtError(
                f"{mpath}: exported from another {what} checkpoint than {path}; re-export with `{exp.fix_hint()}`"
            )

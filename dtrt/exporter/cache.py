"""The export a registry model runs from when no --export is given: made on first use with `dtrt export`'s
defaults under <cache>/exports/<model>-<dtrt version>, checked against the checkpoints on every load and made
again when they changed (a new shipped drafter, a re-converted target)."""
from pathlib import Path

from dtrt import __version__
from dtrt.errors import DtrtError
from dtrt.exporter.artifact import Export, check_source, load_export
from dtrt.models.registry import Pair, cache_dir


def cached_export(pair: Pair, model: str, log=None) -> Export:
    log = log or (lambda msg: None)
    path = cache_dir() / "exports" / f"{model}-{__version__}"
    drafters = {k: p for k, p in (("dflash", pair.dflash), ("domino", pair.domino)) if p is not None}
    if path.exists():
        try:
            exp = load_export(path)
            check_source(exp, pair.target, model, drafters)
            return exp
        except DtrtError as e:
            log(f"{path}: out of date ({e}); exporting again")
    from dtrt.exporter.export import export_pair

    log(f"exporting {model} to ONNX in {path} (first use only)")
    return export_pair(pair, Path(path), model, force=True, log=log)

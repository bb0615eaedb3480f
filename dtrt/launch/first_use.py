"""The export a registry model runs from when no --export is given: made on first use under
<cache>/exports/<model>-<dtrt version> with `dtrt export`'s defaults and `--drafter-quant int8` (this export only
ever runs on ONNX Runtime's CPU kernels, where int8 drafter weights cut the draft time and leave the output
unchanged), checked against the checkpoints on every load and made again when they or those options changed."""

from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.export import LAYOUT, Export, check_source, load_export
from dtrt.artifacts.files import MANIFEST, cache_dir
from dtrt.errors import DtrtError
from dtrt.launch.memory import check_first_use
from dtrt.models.checkpoint import Pair
from dtrt.models.quant import quant_spec
from dtrt.zoo.registry import default_quant

DRAFTER_QUANT = "int8"


def export_pair(*args, **kwargs) -> Export:
    """dtrt.exporter's export_pair, imported only to export (onnx and torch.onnx take seconds to import)."""
    from dtrt.exporter.export import export_pair as export

    return export(*args, **kwargs)


def cached_export(pair: Pair, model: str, log=None, quant: str = "none") -> Export:
    """`quant`: the target's quantization (`dtrt export --quant`, its default block and method); each has its own
    directory."""
    log = log or (lambda msg: None)
    path = cache_dir() / "exports" / (f"{model}-{__version__}" + ("" if quant == "none" else f"-{quant}"))
    qspec = quant_spec(quant)
    drafters = {k: p for k, p in (("dflash", pair.dflash), ("domino", pair.domino)) if p is not None}
    if path.exists():
        try:
            exp = load_export(path)
            check_source(exp, pair.target, model, drafters)
            if exp.manifest.get("drafter_quant", "none") != DRAFTER_QUANT:
                raise DtrtError(f"{path / MANIFEST}: drafter_quant is not {DRAFTER_QUANT}")
            if exp.quant != qspec:
                raise DtrtError(f"{path / MANIFEST}: its target is {exp.quant_name}, not {quant}")
            if exp.manifest.get("layout") != LAYOUT:
                raise DtrtError(f"{path / MANIFEST}: made by an earlier dtrt (layout {exp.manifest.get('layout', 1)})")
            return exp
        except DtrtError as e:
            log(f"{path}: out of date ({e}); exporting again")
    else:
        others = sorted(p.name for p in path.parent.glob(f"{model}-{__version__}*") if p.is_dir() and p != path)
        if others:  # say why a cache that already holds this model exports again: another target configuration
            default = default_quant(model)
            log(
                f"{model}: no export of its {'fp32' if quant == 'none' else quant} target in the cache yet (it holds "
                f"{', '.join(others)}); the registry's default target is {'fp32' if default == 'none' else default}, "
                f"the configuration that passes the quality gate (dtrt quality)"
            )
    check_first_use(pair, model, quant=quant)
    log(f"exporting {model} to ONNX in {path} (first use only)")
    return export_pair(pair, Path(path), model, force=True, drafter_quant=DRAFTER_QUANT, quant=qspec, log=log)

"""The export a registry model runs from when no --export is given: made on first use under
<cache>/exports/<model>-<dtrt version> with `dtrt export`'s defaults and the registry's `--drafter-quant` for the
target's quantization (this export only ever runs on ONNX Runtime's CPU kernels, where quantized drafter weights
cut the draft time and leave the output unchanged; dtrt.exporter.quantize says what each quantizes), checked
against the checkpoints on every load and made again when they or those options changed."""

from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.export import LAYOUT, Export, check_source, load_export
from dtrt.artifacts.files import MANIFEST, cache_dir
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.quantize import quantized_stages
from dtrt.launch.memory import check_first_use, export_jobs
from dtrt.models.pair import Pair
from dtrt.models.quant_spec import quant_spec
from dtrt.zoo.registry import default_draft_vocab, default_drafter_quant, default_quant


def export_pair(*args, **kwargs) -> Export:
    """dtrt.exporter's export_pair, imported only to export (onnx and torch.onnx take seconds to import)."""
    from dtrt.exporter.write import export_pair as export

    return export(*args, **kwargs)


def cached_export(pair: Pair, model: str, log=None, quant: str = "none", draft_vocab: str | None = None) -> Export:
    """`quant`: the target's quantization (`dtrt export --quant`, its default block and method); `draft_vocab`:
    the drafters' vocabulary (`--draft-vocab`; None: each drafter's own subset, where it has one); each has its own
    directory."""
    log = log or (lambda msg: None)
    drafters = {k: p for k, p in (("dflash", pair.dflash), ("domino", pair.domino)) if p is not None}
    asked = draft_vocab  # the default keeps the default directory, whichever subset the registry gives the target
    if draft_vocab in (None, "auto"):
        draft_vocab = registry_vocab(pair, model, quant)
    vocabs = pair_vocabs(pair, drafters, draft_vocab)
    tag = "" if asked in (None, "auto") else "-fullvocab" if asked == "full" else f"-vocab{_short(vocabs)}"
    path = cache_dir() / "exports" / (f"{model}-{__version__}" + ("" if quant == "none" else f"-{quant}") + tag)
    qspec = quant_spec(quant)
    if path.exists():
        try:
            exp = load_export(path)
            check_source(exp, pair.target, model, drafters)
            for kind, sha in vocabs.items():
                rec = exp.drafters.get(kind, {}).get("draft_vocab") or {}
                if rec.get("sha256") != sha:
                    raise DtrtError(f"{path / MANIFEST}: the {kind} drafter's draft vocabulary is not {sha or 'full'}")
            want = default_drafter_quant(model, quant)
            have = exp.manifest.get("drafter_quant", "none"), exp.manifest.get("quantized_stages")
            if have != (want, quantized_stages(exp.manifest["stages"], want)):
                raise DtrtError(f"{path / MANIFEST}: its drafter stages are not quantized as --drafter-quant {want}")
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
    if quant != "none":  # a quantized target's sessions run dtrt's kernels: compiled on the other core meanwhile
        from dtrt.runtime.backends import ort_ops

        ort_ops.build_in_background()
    drafter_quant = default_drafter_quant(model, quant)
    jobs = export_jobs(pair)
    cfg = ExportConfig(force=True, drafter_quant=drafter_quant, quant=quant, draft_vocab=draft_vocab, jobs=jobs)
    return export_pair(pair, Path(path), cfg, model=model, log=log)


def registry_vocab(pair: Pair, model: str, quant: str) -> str | None:
    """The subset the registry gives `model`'s `quant` target (a file beside its Domino drafter), None for the
    drafters' own."""
    name = default_draft_vocab(model, quant)
    if name is None or pair.domino is None or not (Path(pair.domino) / name).is_file():
        return None
    return str(Path(pair.domino) / name)


def pair_vocabs(pair: Pair, drafters: dict, draft_vocab: str | None) -> dict[str, str | None]:
    """Per drafter kind, the sha256 of the draft vocabulary an export of `pair` under `--draft-vocab` would cover
    (None: the whole vocabulary)."""
    from dtrt.models.config import read_json
    from dtrt.models.draft_vocab import resolve_draft_vocab

    vocab_size = read_json(Path(pair.target) / "config.json")["vocab_size"]
    out = {}
    for kind, path in drafters.items():
        vocab = resolve_draft_vocab(draft_vocab, path, vocab_size)
        out[kind] = vocab.sha256 if vocab is not None else None
    return out


def _short(vocabs: dict) -> str:
    return next((sha[:8] for sha in vocabs.values() if sha), "")

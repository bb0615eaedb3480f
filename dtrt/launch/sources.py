"""Opening what a RunSpec runs from: registry names resolved to checkpoints (the tiny pairs and the SmolLM2
conversion made on first use), exports and engines read and checked, and the first-use export of a registry model
made into the cache. This is the front end's decision, never the runtime's."""

from pathlib import Path

from dtrt.artifacts.export import check_source, load_export
from dtrt.errors import DtrtError
from dtrt.launch.first_use import cached_export
from dtrt.models.checkpoint import Pair
from dtrt.runtime.pipeline import Pipeline, Sources, open_pipeline
from dtrt.runtime.spec import RunSpec
from dtrt.zoo.registry import resolve


def load_pair(spec: RunSpec, log=None) -> Pair | None:
    """The checkpoints the spec names (None when an export runs alone)."""
    if spec.target is not None:
        return Pair(spec.target, spec.drafter, spec.drafter)
    if spec.model is not None:
        return resolve(spec.model, spec.model_dir, log=log)
    return None


def open_sources(spec: RunSpec, log=None, pair: Pair | None = None) -> Sources:
    """The spec's sources; `pair`: checkpoints already at hand instead of the ones the spec names."""
    pair = pair or load_pair(spec, log)
    if spec.backend == "torch":
        return Sources(pair=pair)
    if spec.backend == "tensorrt":
        if spec.engines is None:
            raise DtrtError(
                "--backend tensorrt needs --engines DIR: an engine directory written by `dtrt build-engine` "
                "(or the --out root it was given)"
            )
        from dtrt.artifacts.engine import open_engine

        engine, exp = open_engine(spec.engines, spec.model)
        if pair is not None:
            check_source(exp, pair.target, spec.model)
        return Sources(pair=pair, export=exp, engine=engine)
    if spec.export is not None:
        exp = load_export(spec.export)
        if pair is not None:
            check_source(exp, pair.target, spec.model)
    elif spec.model is not None:
        exp = cached_export(pair, spec.model, log, spec.quant or "none", spec.draft_vocab)
    else:
        raise DtrtError(
            "--backend onnxruntime needs --export DIR (write one with `dtrt export --model NAME --out DIR`) or "
            "--model NAME (exported into the cache on first use)"
        )
    return Sources(pair=pair, export=exp)


def pipeline(spec: RunSpec, log=None) -> Pipeline:
    """open_pipeline over the spec's opened sources: what every front end runs."""
    return open_pipeline(spec, open_sources(spec, log))


def served_model_name(spec: RunSpec, sources: Sources, override: str | None = None) -> str:
    """The model id `dtrt serve` answers to (what clients send as `model` and /v1/models lists): `override`
    (--served-model-name), else the registry name, else the target checkpoint directory's name (for an export, the
    model or checkpoint it was exported from, as its manifest records)."""
    if override:
        return override
    if spec.model is not None:
        return spec.model
    if spec.target is not None:
        return Path(spec.target).resolve().name
    src = sources.export.manifest.get("source", {}) if sources.export is not None else {}
    if src.get("model"):
        return src["model"]
    if src.get("target"):
        return Path(src["target"]).name
    return Path(spec.export or spec.engines).resolve().name

"""`dtrt build-engine`: one TensorRT plan per stage of an export, for this machine's GPU and TensorRT.

Strongly typed networks (the precision is the ONNX graph's), the dtrt plugins registered before parsing so the
parser takes them for the `dtrt` nodes, the optimization profiles of dtrt.engines.profile_bounds, and one timing
cache shared by every stage (and kept, so a rebuild re-times nothing). The directory is written under a
temporary name next to the output and renamed into place when complete.
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrt import __version__
from dtrt.artifacts.engine import FORMAT, TIMING_CACHE, Engine, export_digest, read_engine
from dtrt.artifacts.export import Export, load_export
from dtrt.artifacts.files import require_space, staging, write_manifest
from dtrt.artifacts.gpu import Machine, engine_dir, probe_machine
from dtrt.artifacts.verify import record_verified
from dtrt.engines.profile_bounds import Limits, onnx_signature, stage_profiles
from dtrt.errors import DtrtError, first_line
from dtrt.plugins import NAMESPACE, OPS, PLUGIN_VERSION, sources_sha256


@dataclass(frozen=True)
class BuildConfig:
    max_batch: int = 8  # requests of the batched frontier stage
    opt_level: int = 3  # TensorRT builder optimization level, 0..5

    def __post_init__(self):
        if self.max_batch < 1:
            raise DtrtError(f"--max-batch {self.max_batch}: must be >= 1")
        if not 0 <= self.opt_level <= 5:
            raise DtrtError(f"--opt-level {self.opt_level}: must be in 0..5")


def model_name(exp: Export) -> str:
    return exp.manifest["source"].get("model") or exp.path.name


def plan_stages(exp: Export, cfg: BuildConfig) -> dict[str, dict]:
    """Stage -> {"plan", "inputs", "outputs", "profiles"} for every stage of the export."""
    limits = Limits.of_export(exp.manifest, cfg.max_batch)
    stages = {}
    for name in exp.manifest["stages"]:
        inputs, outputs = onnx_signature(exp.stage(name))
        stages[name] = {
            "plan": f"{name}.plan",
            "inputs": inputs,
            "outputs": outputs,
            "profiles": [p.to_json() for p in stage_profiles(name, inputs, limits)],
        }
    return stages


def plans_need(exp: Export) -> int:
    """About the bytes the plans take: the export's files, whose weights the plans hold in the graphs' own precision
    (strongly typed), once per stage as the export does."""
    return sum(f["size"] for f in exp.manifest.get("files", {}).values())


def engine_manifest(exp: Export, machine: Machine, cfg: BuildConfig, stages: dict) -> dict:
    return {
        "format": FORMAT,
        "dtrt_version": __version__,
        "machine": machine.to_json(),
        "key": machine.key,
        "model": model_name(exp),
        "export": {"path": str(exp.path.resolve()), "manifest_sha256": export_digest(exp)},
        "build": asdict(cfg),
        "plugins": {"namespace": NAMESPACE, "version": PLUGIN_VERSION, "ops": list(OPS), "sha256": sources_sha256()},
        "stages": stages,
    }


def build_engines(export_dir, out_root, cfg: BuildConfig = BuildConfig(), force: bool = False, log=None) -> Engine:
    log = log or (lambda msg: None)
    exp = load_export(export_dir)
    if exp.manifest.get("quantized_stages"):
        raise DtrtError(
            f"{exp.path}: its drafter stages have quantized weights (--drafter-quant "
            f"{exp.manifest['drafter_quant']}), which run on ONNX Runtime only; for TensorRT re-export "
            f"with `{exp.fix_hint(drafter_quant='none')}`"
        )
    if exp.quant is not None:
        raise DtrtError(
            f"{exp.path}: its target has {exp.quant_name} weights (--quant {exp.quant_name}), which dtrt runs on ONNX "
            f"Runtime only for now; for TensorRT re-export with `{exp.fix_hint(quant='none')}`"
        )
    machine = probe_machine("dtrt build-engine")
    out = engine_dir(out_root, machine, model_name(exp))
    if out.exists() and not force:
        raise DtrtError(f"--out {out_root}: {out} already exists; pass --force to rebuild it")
    stages = plan_stages(exp, cfg)
    require_space(out, plans_need(exp), "this build", "free space there, or build elsewhere (`--out DIR`)")

    old_cache = out / TIMING_CACHE
    cache_bytes = old_cache.read_bytes() if old_cache.is_file() else b""
    with staging(out) as tmp:
        (tmp / TIMING_CACHE).write_bytes(_build_plans(exp, stages, machine, cfg, tmp, cache_bytes, log))
        manifest = engine_manifest(exp, machine, cfg, stages)
        write_manifest(tmp, manifest)
    record_verified(out, manifest["files"])
    return read_engine(out)


def _build_plans(
    exp: Export, stages: dict, machine: Machine, cfg: BuildConfig, out: Path, cache_bytes: bytes, log
) -> bytes:
    """Write `<stage>.plan` for every stage into `out`; returns the serialized timing cache."""
    import tensorrt as trt

    from dtrt.plugins.trt import register_plugins

    register_plugins(machine.compute_capability)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    if builder is None:
        raise DtrtError("TensorRT cannot create a builder on this machine (see its log above)")
    flags = 0
    for name in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):
        flag = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if flag is not None:
            flags |= 1 << int(flag)
    cache = None
    for i, (name, meta) in enumerate(stages.items(), 1):
        t0 = time.perf_counter()
        log(f"[{i}/{len(stages)}] building {name}")
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        path = exp.stage(name)
        if not parser.parse_from_file(str(path)):
            errors = "; ".join(str(parser.get_error(j)) for j in range(parser.num_errors))
            raise DtrtError(
                f"{path}: the TensorRT ONNX parser rejects it ({errors[:300]}); re-export with `{exp.fix_hint()}`"
            )
        config = builder.create_builder_config()
        config.builder_optimization_level = cfg.opt_level
        if cache is None:
            cache = config.create_timing_cache(cache_bytes)
        config.set_timing_cache(cache, ignore_mismatch=True)
        for prof in meta["profiles"]:
            profile = builder.create_optimization_profile()
            for inp, (lo, opt, hi) in prof["shapes"].items():
                profile.set_shape(inp, lo, opt, hi)
            for inp, (lo, opt, hi) in prof.get("values", {}).items():  # shape tensors: the block's rows
                profile.set_shape_input(inp, lo, opt, hi)
            config.add_optimization_profile(profile)
        try:
            plan = builder.build_serialized_network(network, config)
        except Exception as e:  # a plugin's AOT compile raising surfaces here
            raise DtrtError(f"{name}: TensorRT could not build it ({first_line(e)})") from None
        if plan is None:
            raise DtrtError(f"{name}: TensorRT could not build it (see its log above)")
        (out / meta["plan"]).write_bytes(bytes(plan))
        log(f"[{i}/{len(stages)}] {name} done in {time.perf_counter() - t0:.1f}s")
    return bytes(cache.serialize()) if cache is not None else b""

"""The artifact commands: `dtrt export`, `verify`, `parity`, `build-engine` and `doctor`."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from dtrt.cli.base import MODEL_DIR_HELP, cli, log_line
from dtrt.cli.options import FILLED_IN, option_from
from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.models.pair import Pair
from dtrt.zoo.registry import names


@cli.command()
@click.option("--model", help=f"registry name: {', '.join(names())}")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (DFlash or Domino)")
@click.option(
    "--gguf",
    type=click.Path(),
    help="a llama, qwen2 or qwen3 GGUF file as the target (instead of --model/--target): converted once into the "
    "cache, its quantized tensors kept as the file holds them (--quant gguf unless --quant is given)",
)
@click.option("--model-dir", type=click.Path(), help=MODEL_DIR_HELP)
@click.option("--out", required=True, type=click.Path(), help="export directory to create")
@option_from(ExportConfig, "dtype")
@option_from(ExportConfig, "max_context")
@option_from(ExportConfig, "budget")
@option_from(ExportConfig, "topm")
@option_from(ExportConfig, "node_topk")
@option_from(ExportConfig, "drafter_quant")
@option_from(ExportConfig, "drafters")
@option_from(ExportConfig, "quant")
@option_from(ExportConfig, "quant_block")
@option_from(ExportConfig, "quant_method")
@option_from(ExportConfig, "draft_vocab")
@option_from(
    ExportConfig, "jobs", default=FILLED_IN, help="[default: 2 on two or more cores with the memory for it, else 1]"
)
@option_from(ExportConfig, "force")
def export(model, target, drafter, gguf, model_dir, out, **fields):
    """Export every stage to ONNX, with manifest.json, into OUT (complete or not at all)."""
    from dtrt.exporter.write import export_pair
    from dtrt.launch import resolve_spec
    from dtrt.launch.memory import export_jobs
    from dtrt.launch.start import load_pair

    jobs = fields.pop("jobs")
    if gguf is not None:
        if model or target:
            raise DtrtError("--gguf names the target: drop --model and --target")
        if click.get_current_context().get_parameter_source("quant") is ParameterSource.DEFAULT:
            fields["quant"] = "gguf"
    cfg = ExportConfig(**fields, jobs=1 if jobs is None else jobs)  # every flag checked before a conversion or a load
    if gguf is not None:
        from dtrt.zoo.gguf import converted

        pair = Pair(converted(Path(gguf), log_line), *(2 * [Path(drafter) if drafter else None]))
        source = {"gguf": Path(gguf)}
    else:
        spec = resolve_spec(model=model, target=target, drafter=drafter, model_dir=model_dir, backend="torch")
        pair, source = load_pair(spec, log=log_line), {"model": spec.model}
    if jobs is None:
        cfg = replace(cfg, jobs=export_jobs(pair, cfg.dtype))
    exp = export_pair(pair, Path(out), cfg, log=log_line, **source)
    size = sum(m["size"] for m in exp.manifest["files"].values())
    click.echo(f"{exp.path}: {len(exp.manifest['stages'])} stages, {size / 1e6:.1f} MB")


@cli.command(cls=click.Command)  # hashes files: no torch
@click.argument("directory", type=click.Path())
def verify(directory):
    """Hash every file of an export or engine DIRECTORY against its manifest (loads check only changed files)."""
    from dtrt.artifacts.directory import verify_dir

    files, size = verify_dir(Path(directory))
    click.echo(f"{directory}: {files} files, {size / 1e6:.1f} MB, every sha256 matches its manifest")


@cli.command()
@click.argument("export_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
@click.option("--random-only", is_flag=True, help="skip the inputs captured from real generations")
@click.option(
    "--prompts",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="prompts the real inputs are captured from",
)
@click.option("--quick", is_flag=True, help="one random case per stage (N=9, P=7), for models too large for the grid")
def parity(export_dir, as_json, random_only, prompts, quick):
    """Compare every stage of EXPORT_DIR under ONNX Runtime with its PyTorch reference on the same inputs."""
    from dtrt.artifacts.export import load_export
    from dtrt.parity import run_parity

    report = run_parity(load_export(export_dir), 0 if random_only else prompts, log=log_line, quick=quick)
    click.echo(json.dumps(report.to_json()) if as_json else report.table())
    if not report.ok:
        log_line(f"parity failed: {', '.join(report.failed)}")
        sys.exit(1)


@cli.command("build-engine")
@click.argument("export_dir", type=click.Path())
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="engines root: the plans go to OUT/<gpu>-sm<cc>-trt<version>-cu<cuda>/<model>/",
)
@click.option("--max-batch", type=int, default=8, show_default=True, help="largest batch of the frontier stage")
@click.option("--opt-level", type=int, default=3, show_default=True, help="TensorRT builder optimization level 0..5")
@click.option("--force", is_flag=True, help="rebuild an existing engine directory")
def build_engine(export_dir, out, max_batch, opt_level, force):
    """Build one TensorRT plan per stage of EXPORT_DIR for this GPU (complete or not at all)."""
    from dtrt.engines.build import BuildConfig, build_engines

    eng = build_engines(export_dir, out, BuildConfig(max_batch, opt_level), force, log=log_line)
    size = sum(m["size"] for m in eng.manifest["files"].values())
    click.echo(f"{eng.path}: {len(eng.manifest['stages'])} plans, {size / 1e6:.1f} MB")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the report")
def doctor(as_json):
    """Report the backends, devices, TensorRT and plugin libraries available here, and why any is not."""
    from dtrt.engines.doctor import render, run_checks, to_json

    checks, backends = run_checks()
    click.echo(json.dumps(to_json(checks, backends)) if as_json else render(checks, backends))

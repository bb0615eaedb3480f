"""The `dtrt` command line."""
import json
import sys
from pathlib import Path

import click
import torch

from dtrt import __version__
from dtrt.errors import DtrtError
from dtrt.models.checkpoint import DTYPES
from dtrt.runtime.methods import ARMS, BUILDERS, METHODS, DraftConfig
from dtrt.runtime.pipeline import BACKENDS, build_pipeline, load_pair
from dtrt.runtime.sampling import SamplingConfig


def _log(msg):
    click.echo(msg, err=True)


@click.group()
@click.version_option(__version__, prog_name="dtrt")
def cli():
    """dtrt: DominoTree speculative decoding, exact to the target model."""


@cli.command()
@click.argument("prompt", required=False)
@click.option("--model", help="registry name: tiny, qwen3-4b, qwen3-8b (default tiny)")
@click.option("--target", type=click.Path(), help="target checkpoint directory (Hugging Face layout)")
@click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (DFlash or Domino layout)")
@click.option("--model-dir", type=click.Path(), help="where registry checkpoints are looked up before the HF cache")
@click.option("--method", type=click.Choice(METHODS), default="dominotree", show_default=True)
@click.option("--builder", type=click.Choice(BUILDERS), default="heap", show_default=True,
              help="dominotree tree builder")
@click.option("--arm", type=click.Choice(ARMS), default="dominotree", show_default=True,
              help="dominotree scoring: per path (dominotree), per depth on the greedy chain (condstatic), none (marg)")
@click.option("--budget", type=int, default=16, show_default=True, help="draft nodes per tree (caddtree: the cap)")
@click.option("--topm", type=int, default=64, show_default=True, help="Domino candidates per depth (0 = full vocab)")
@click.option("--node-topk", type=int, default=8, show_default=True, help="children per tree node")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), help="default fp32 (onnxruntime: the export's)")
@click.option("--backend", type=click.Choice(BACKENDS), default="torch", show_default=True)
@click.option("--export", "export_dir", type=click.Path(), help="export directory (dtrt export) for onnxruntime")
@click.option("--threads", type=int, help="intra-op threads of torch and ONNX Runtime (default: theirs)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the text")
def run(prompt, model, target, drafter, model_dir, method, builder, arm, budget, topm, node_topk, max_new_tokens,
        temperature, top_p, seed, dtype, backend, export_dir, threads, as_json):
    """Generate a continuation of PROMPT (or of standard input)."""
    if prompt is None:
        prompt = sys.stdin.read()
    draft = DraftConfig(method, budget, builder, arm, topm, node_topk)
    sampling = SamplingConfig(temperature, top_p, seed)
    # onnxruntime runs the export alone; with --model/--target the export must come from them
    alone = backend == "onnxruntime" and model is None and target is None and drafter is None
    pair = None if alone else load_pair(model, target, drafter, model_dir, log=_log)
    pipe = build_pipeline(pair, draft, dtype, backend, export_dir, threads, model)
    if threads:
        torch.set_num_threads(threads)
    ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)

    streamed = []

    def stream(tokens):  # print the text as it is committed, decoding the whole output to keep UTF-8 intact
        before = pipe.tokenizer.decode(streamed, skip_special_tokens=True)
        streamed.extend(tokens)
        click.echo(pipe.tokenizer.decode(streamed, skip_special_tokens=True)[len(before):], nl=False)

    out = pipe.generate(ids, max_new_tokens, sampling, None if as_json else stream)
    text = pipe.tokenizer.decode(out.tokens, skip_special_tokens=True)
    if as_json:
        click.echo(json.dumps(result_json(out, text, draft, len(ids))))
    else:
        click.echo()
        _log(f"[{method}] tau {out.tau:.2f}  {out.tokens_per_s:.1f} tok/s  {len(out.tokens)} tokens  "
             f"{len(out.rounds)} rounds  prefill {out.prefill_s * 1e3:.0f} ms")


@cli.command()
@click.option("--model", help="registry name: tiny, qwen3-4b, qwen3-8b")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (DFlash or Domino)")
@click.option("--model-dir", type=click.Path(), help="where registry checkpoints are looked up before the HF cache")
@click.option("--out", required=True, type=click.Path(), help="export directory to create")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--max-context", type=int, default=4096, show_default=True, help="largest past + new tokens")
@click.option("--budget", type=int, default=16, show_default=True, help="tree budget of the fixed-shape stages")
@click.option("--topm", type=int, default=64, show_default=True)
@click.option("--node-topk", type=int, default=8, show_default=True)
@click.option("--force", is_flag=True, help="replace an existing export directory")
def export(model, target, drafter, model_dir, out, dtype, max_context, budget, topm, node_topk, force):
    """Export every stage to ONNX, with manifest.json, into OUT (complete or not at all)."""
    from dtrt.exporter.export import export_pair

    pair = load_pair(model, target, drafter, model_dir, log=_log)
    exp = export_pair(pair, Path(out), model if target is None else None, dtype, max_context, budget, topm,
                      node_topk, force, log=_log)
    size = sum(m["size"] for m in exp.manifest["files"].values())
    click.echo(f"{exp.path}: {len(exp.manifest['stages'])} stages, {size / 1e6:.1f} MB")


@cli.command()
@click.argument("export_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
@click.option("--random-only", is_flag=True, help="skip the inputs captured from real generations")
@click.option("--prompts", type=click.IntRange(min=1), default=3, show_default=True,
              help="prompts the real inputs are captured from")
def parity(export_dir, as_json, random_only, prompts):
    """Compare every stage of EXPORT_DIR under ONNX Runtime with its PyTorch reference on the same inputs."""
    from dtrt.exporter.artifact import load_export
    from dtrt.exporter.parity import run_parity

    report = run_parity(load_export(export_dir), 0 if random_only else prompts, log=_log)
    click.echo(json.dumps(report.to_json()) if as_json else report.table())
    if not report.ok:
        _log(f"parity failed: {', '.join(report.failed)}")
        sys.exit(1)


def result_json(out, text, draft: DraftConfig, prompt_tokens: int) -> dict:
    stage = {k: sum(getattr(r, f"{k}_s") for r in out.rounds) for k in ("draft", "build", "verify", "commit")}
    return {
        "tokens": out.tokens, "text": text, "tau": out.tau, "tokens_per_s": out.tokens_per_s,
        "rounds": len(out.rounds), "method": draft.method, "budget": draft.budget, "prompt_tokens": prompt_tokens,
        "prefill_s": out.prefill_s, "decode_s": out.decode_s, "stop_reason": out.stop_reason,
        "stage_s": stage, "accepted": [r.accepted for r in out.rounds],
        "tree_sizes": [r.tree_size for r in out.rounds],
    }


def main():
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _log("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        _log("interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DtrtError as e:
        _log(f"error: {e}")
        sys.exit(2)

"""The `dtrt` command line: each command parses its flags, resolves a RunSpec once (dtrt.launch), opens the
pipeline and hands it to the runtime, the server or the bench."""

import json
import os
import sys
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import click

from dtrt import __version__
from dtrt.cli.options import FILLED_IN, option_from, options_from
from dtrt.errors import BackendFault, DtrtError
from dtrt.exporter.config import ExportConfig
from dtrt.frontend.requests import FLAGS, check_thinking, has_chat_template, make_request, read_requests
from dtrt.frontend.terminal import generate_one, prompt_ids, repl, stats_line
from dtrt.launch import pipeline, resolve_spec
from dtrt.launch.resolve import check_cuda
from dtrt.launch.sources import load_pair
from dtrt.models.quant import QUANTS
from dtrt.runtime.spec import RunSpec
from dtrt.serve.worker import ServeConfig
from dtrt.train.datagen import DataGenConfig
from dtrt.train.trainer import TrainConfig
from dtrt.zoo.registry import DEFAULT_MODEL, budget_help, lookup_help, method_help, names, quant_help

MODEL_DIR_HELP = "where registry checkpoints are looked up before the Hugging Face cache"
DRAFT_VOCAB_HELP = (
    "the vocabulary the drafter drafts from: full, or a subset file (dtrt draft-vocab); default: the drafter's own "
    "d2t.safetensors where it has one (an export: the one it was exported with), else full"
)
QUANT_HELP = (
    "the target's linear layers, lm_head included, as weight-only int8 (per output channel) or int4 (per block); "
    "the quantized model is the target every method reproduces"
)


def _log(msg):
    click.echo(msg, err=True)


@click.group()
@click.version_option(__version__, prog_name="dtrt")
def cli():
    """dtrt: DominoTree speculative decoding, exact to the target model."""


def source_options(f, *, quant_sweep: bool = False):
    """The flags that say what runs where, shared by `run`, `serve` and `bench` (`quant_sweep`: --quant is a comma
    list, bench's grid axis)."""
    quant_help_ = (
        f"target weights: {QUANT_HELP} (an export backend: the export's; a registry model's first-use "
        f"export: default {quant_help()}; torch: the dequantized weights)"
    )
    if quant_sweep:
        quant_help_ += f"; a comma list ({','.join(QUANTS)}) runs every row per quantization, each against its own AR"
    opts = [
        click.option(
            "--model",
            help=f"registry name: {', '.join(names())} (default {DEFAULT_MODEL} when no --target or --export is given)",
        ),
        click.option("--target", type=click.Path(), help="target checkpoint directory (Hugging Face layout)"),
        click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (DFlash or Domino layout)"),
        click.option("--model-dir", type=click.Path(), help=MODEL_DIR_HELP),
        option_from(RunSpec, "dtype", default=FILLED_IN),
        click.option("--quant", type=None if quant_sweep else click.Choice(QUANTS), help=quant_help_),
        option_from(
            RunSpec,
            "backend",
            default=FILLED_IN,
            help="Default: onnxruntime for the default model or an --export, torch for --model/--target.",
        ),
        click.option(
            "--export",
            type=click.Path(),
            help="export directory (dtrt export) for onnxruntime; engine directory (dtrt build-engine) for tensorrt",
        ),
        option_from(RunSpec, "threads"),
        option_from(RunSpec, "device", default=FILLED_IN, help="Default cpu; on CUDA the ops run Triton kernels."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def method_options(f):
    """The flags that choose the method and its tree, shared by `run` and `serve`."""
    opts = [
        option_from(RunSpec, "method", default=FILLED_IN, help=f"Default {method_help()}."),
        option_from(RunSpec, "builder", default=FILLED_IN, help="Default: frontier on --device cuda, else heap."),
        option_from(RunSpec, "arm"),
        option_from(RunSpec, "budget", default=FILLED_IN, help=f"Default {budget_help()}."),
        option_from(RunSpec, "topm"),
        option_from(RunSpec, "node_topk"),
        option_from(RunSpec, "cuda_graph"),
        option_from(RunSpec, "lookup", "--lookup/--no-lookup", default=FILLED_IN, help=f"Default: {lookup_help()}."),
        option_from(RunSpec, "draft_vocab", replace_help=True, help=DRAFT_VOCAB_HELP),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def request_options(f):
    """The flags a request leaves out take, shared by `run` and `serve`."""
    opts = [
        click.option(
            "--max-new-tokens",
            type=int,
            default=128,
            show_default=True,
            help="stop after this many tokens (serve: for requests without max_tokens)",
        ),
        click.option(
            "--temperature",
            type=float,
            default=0.0,
            show_default=True,
            help="0: greedy (serve: for requests without one)",
        ),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True, help="makes T>0 runs reproducible"),
        click.option(
            "--truncate",
            is_flag=True,
            help="keep the prompt's last tokens when prompt + new tokens exceed the context (else an error)",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


THINKING_HELP = (
    "render the chat template with thinking on (Qwen3's enable_thinking); off by default: the assistant's turn opens "
    "with the empty think block the released drafters were trained with"
)


def thinking_option(f):
    """--thinking/--no-thinking, shared by `run`, `serve` and `bench`."""
    return click.option("--thinking/--no-thinking", default=False, show_default=True, help=THINKING_HELP)(f)


def _use_chat(pipe, chat: bool | None) -> bool:
    """--chat/--no-chat, by default the chat template when the tokenizer has one."""
    if chat and not has_chat_template(pipe.tokenizer):
        raise DtrtError(
            "--chat: this model's tokenizer has no chat template; drop --chat (the prompt is then used as raw text)"
        )
    return has_chat_template(pipe.tokenizer) if chat is None else chat


@cli.command()
@click.argument("prompt", required=False)
@source_options
@method_options
@request_options
@click.option("--stop", multiple=True, help="stop string (repeatable): the output ends before it")
@click.option(
    "--chat/--no-chat", default=None, help="wrap the prompt in the chat template (default: when the tokenizer has one)"
)
@thinking_option
@click.option(
    "--input",
    "input_file",
    type=click.Path(allow_dash=True),
    help="JSONL file of requests ('-' = standard input), one JSON result per line",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the text")
def run(prompt, max_new_tokens, temperature, top_p, seed, stop, chat, thinking, truncate, input_file, as_json, **flags):
    """Generate a continuation of PROMPT (or of standard input; an interactive prompt at a terminal)."""
    defaults = make_request(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        thinking=thinking,
        names=FLAGS,
    )
    spec = resolve_spec(**flags)
    if prompt is not None and input_file is not None:
        raise DtrtError("PROMPT and --input exclude each other: pass one")
    requests = read_requests(input_file, defaults) if input_file is not None else None
    interactive = prompt is None and requests is None and sys.stdin.isatty()
    if prompt is None and requests is None and not interactive:
        prompt = sys.stdin.read()
    pipe = pipeline(spec, _log)
    chat = _use_chat(pipe, chat)
    check_thinking(pipe.tokenizer, thinking)
    if interactive:
        _log(f"dtrt run ({spec.method}): one prompt per line; Ctrl-C stops a generation, Ctrl-D quits")
        return repl(pipe, defaults, chat, truncate, input, lambda s: click.echo(s, nl=False), _log)
    if requests is not None:
        return _run_jsonl(pipe, requests, chat, truncate, input_file)
    req = replace(defaults, prompt=prompt)
    c = generate_one(
        pipe, req, prompt_ids(pipe, req, chat, truncate), None if as_json else lambda s: click.echo(s, nl=False)
    )
    if as_json:
        click.echo(json.dumps(c.to_json(spec)))
    else:
        click.echo()
        _log(stats_line(c, spec.method))
    if c.stop_reason == "cancelled":
        sys.exit(130)


def _run_jsonl(pipe, requests, chat, truncate, source):
    """Every line is encoded and fitted before the first generation, so a bad line stops the run before any output."""
    prepared = []
    for line, rid, req in requests:
        try:
            prepared.append((rid, req, prompt_ids(pipe, req, chat, truncate)))
        except DtrtError as e:
            raise DtrtError(f"{source}:{line}: {e}") from None
    for rid, req, ids in prepared:
        c = generate_one(pipe, req, ids)
        click.echo(json.dumps(({} if rid is None else {"id": rid}) | c.to_json(pipe.spec)))
        if c.stop_reason == "cancelled":
            sys.exit(130)


@cli.command()
@source_options
@method_options
@request_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="TCP port (0: any free one, printed at start)",
)
@click.option(
    "--served-model-name",
    "--name",
    "name",
    help="the model id clients send and /v1/models lists (default: the --model name, or the name of the checkpoint "
    "directory the target, or the --export, comes from)",
)
@option_from(ServeConfig, "queue_limit")
@option_from(ServeConfig, "request_timeout")
@option_from(ServeConfig, "shutdown_grace")
@option_from(ServeConfig, "api_key", envvar="DTRT_API_KEY", show_envvar=True)
@option_from(ServeConfig, "max_request_bytes")
@option_from(ServeConfig, "max_prompt_tokens")
@click.option(
    "--replicas",
    type=int,
    help='run N replicas of the pipeline on Ray Serve behind this server (pip install "dtrt[ray]"); without it, '
    "one pipeline in this process",
)
@click.option(
    "--max-replicas",
    type=int,
    help="autoscale between --replicas and this many replicas from their queue lengths",
)
@click.option(
    "--ray-address",
    help="join the Ray cluster this machine is a node of (auto, or HEAD:6379) instead of starting Ray here; dtrt "
    "must be installed on every node",
)
@thinking_option
def serve(max_new_tokens, temperature, top_p, seed, thinking, truncate, host, port, name, **flags):
    """An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from dtrt.serve.main import serve as run_server

    replicas = {k: flags.pop(k) for k in ("replicas", "max_replicas", "ray_address")}
    cfg = {f.name: flags.pop(f.name) for f in fields(ServeConfig) if f.name in flags}
    spec = resolve_spec(**flags)
    defaults = make_request(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, thinking=thinking
    )
    cfg = ServeConfig("", defaults, truncate=truncate, **cfg)
    run_server(spec, cfg, host=host, port=port, name=name, thinking=thinking, log=_log, **replicas)


@cli.command()
@click.option("--model", help=f"registry name: {', '.join(names())}")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (DFlash or Domino)")
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
@option_from(ExportConfig, "force")
def export(model, target, drafter, model_dir, out, **fields):
    """Export every stage to ONNX, with manifest.json, into OUT (complete or not at all)."""
    from dtrt.exporter.export import export_pair

    cfg = ExportConfig(**fields)
    spec = resolve_spec(model=model, target=target, drafter=drafter, model_dir=model_dir, backend="torch")
    exp = export_pair(load_pair(spec, log=_log), Path(out), cfg, model=spec.model, log=_log)
    size = sum(m["size"] for m in exp.manifest["files"].values())
    click.echo(f"{exp.path}: {len(exp.manifest['stages'])} stages, {size / 1e6:.1f} MB")


@cli.command()
@click.argument("directory", type=click.Path())
def verify(directory):
    """Hash every file of an export or engine DIRECTORY against its manifest (loads check only changed files)."""
    from dtrt.artifacts.verify import verify_dir

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

    report = run_parity(load_export(export_dir), 0 if random_only else prompts, log=_log, quick=quick)
    click.echo(json.dumps(report.to_json()) if as_json else report.table())
    if not report.ok:
        _log(f"parity failed: {', '.join(report.failed)}")
        sys.exit(1)


@cli.command()
@click.option(
    "--model",
    help=f"registry model whose first-use ONNX Runtime exports to score against its fp32 PyTorch target: "
    f"{', '.join(names())} (default: {DEFAULT_MODEL})",
)
@click.option(
    "--quant",
    default="none,int8,int4",
    show_default=True,
    help="comma list of target configurations (with --model): none (fp32), int8, int4 as dtrt run runs them "
    "(int8 activations), int8-fp32act, int4-fp32act (fp32 activations; teacher-forced only)",
)
@click.option(
    "--export",
    "exports",
    multiple=True,
    type=click.Path(),
    help="an export directory to score instead (repeatable); the first is the reference",
)
@click.option("--datasets", default="humaneval,mt-bench", show_default=True, help="held-out text: humaneval, mt-bench")
@click.option("--texts", type=click.IntRange(min=1), default=20, show_default=True, help="texts per dataset")
@click.option("--max-tokens", type=click.IntRange(min=2), default=512, show_default=True, help="tokens per text")
@click.option(
    "--prompts",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="free-running: the bench's prompts per dataset answered by greedy AR through the chat template (0: none)",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="per answer")
@click.option(
    "--kernel-path",
    "kernel_paths",
    default="native",
    show_default=True,
    help="comma list of CPU kernel paths to measure the configurations on: native (this CPU's), avx2 (emulated "
    "under qemu-x86_64 -cpu Haswell, about 150x slower); the reference always runs natively",
)
@click.option("--threads", type=click.IntRange(min=1), help="intra-op threads (default: ONNX Runtime's)")
@click.option("--seed", type=int, default=0, show_default=True, help="which texts and prompts")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
def quality(
    model, quant, exports, datasets, texts, max_tokens, prompts, max_new_tokens, kernel_paths, threads, seed, as_json
):  # noqa: E501
    """What a target configuration costs: teacher-forced agreement and NLL, free-running answers against the
    reference, and the quality gate's verdict (dtrt.zoo.gate)."""
    from dtrt.artifacts.export import load_export
    from dtrt.artifacts.kernel_path import EMULATED
    from dtrt.bench.contenders import render
    from dtrt.bench.datasets import load
    from dtrt.bench.main import split_list
    from dtrt.bench.quality import Candidate, config_candidate, held_out, parse_config, quality, table
    from dtrt.models.tokenizer import load_tokenizer

    paths = tuple(split_list("--kernel-path", kernel_paths, str, ("native", *EMULATED)))
    if exports:
        cands = []
        for path in exports:
            exp = load_export(path)
            cands.append(Candidate(f"{exp.quant_name} ({exp.path.name})", export=str(exp.path)))
        reference = cands[0]
        tokenizer = load_tokenizer(Path(exports[0]) / "tokenizer")
    else:
        from dtrt.launch.first_use import cached_export

        configs = split_list("--quant", quant, str, (*QUANTS, *(f"{q}-fp32act" for q in QUANTS if q != "none")))
        spec = resolve_spec(model=model or DEFAULT_MODEL, backend="torch", method="ar")
        pair = load_pair(spec, _log)
        cands = []
        for name in configs:
            exp = cached_export(pair, spec.model, _log, parse_config(name)[0])
            cands.append(config_candidate(name, str(exp.path)))
        reference = Candidate("torch fp32", target=str(pair.target))
        tokenizer = load_tokenizer(pair.target)
    names = [n.strip() for n in datasets.split(",") if n.strip()]
    items = [t for name in names for t in held_out(name, texts, seed)]
    asked = [(name, p.turns[0]) for name in names for p in (load(name, prompts, seed) if prompts else [])]
    rendered = [(name, render(tokenizer, [], turn)) for name, turn in asked]
    rows = quality(
        reference,
        cands,
        items,
        rendered,
        tokenizer,
        max_tokens=max_tokens,
        max_new_tokens=max_new_tokens,
        threads=threads,
        kernel_paths=paths,
        log=_log,
    )
    click.echo(json.dumps({"reference": reference.name, "rows": rows}) if as_json else table(rows, reference.name))


@cli.command("train-drafter")
@click.option("--model", help=f"registry name of the target: {', '.join(names())}")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--model-dir", type=click.Path(), help=MODEL_DIR_HELP)
@click.option("--out", required=True, type=click.Path(), help="run directory: dflash/, domino/, .train/")
@click.option("--corpus", multiple=True, type=click.Path(), help="text file or directory to teacher-force (repeat)")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(),
    help="JSONL ({'prompt': ...}) or text lines the target continues; the last --eval-prompts are held out "
    "unless --held-out is given",
)
@click.option(
    "--held-out",
    "held_out_sets",
    multiple=True,
    help="a set of prompts that held-out tau is measured on (repeat for several, each reported and the best "
    "checkpoint chosen by their mean): a file in the --prompts formats, or a bench dataset (mt-bench, humaneval, "
    "math500, aime, aime24, code-edit: the first turns of the seeded --eval-prompts subset `dtrt bench` takes); "
    "default: the last --eval-prompts of --prompts, else the first halves of the last data rows",
)
@click.option(
    "--data",
    "data_dirs",
    multiple=True,
    type=click.Path(),
    help="a `dtrt drafter-data` directory (repeat): windows of its rows, labelled and featurized by the target",
)
@click.option("--chat/--no-chat", default=True, show_default=True, help="wrap prompts in the chat template")
@click.option("--resume", is_flag=True, help="continue the run in --out")
@options_from(TrainConfig, decls={"time_limit_s": ("--time-limit",)})
def train_drafter_cmd(
    model, target, model_dir, out, corpus, prompts_file, held_out_sets, data_dirs, chat, resume, **opts
):
    """Distil a DFlash drafter and a Domino head from a target into OUT/dflash and OUT/domino."""
    from dtrt.bench.datasets import held_out_set
    from dtrt.frontend.prompts import read_prompts
    from dtrt.train.trainer import train_drafter

    cfg = TrainConfig(**opts)
    check_cuda(cfg.device)
    pair = load_pair(resolve_spec(model=model, target=target, model_dir=model_dir, backend="torch"), log=_log)
    prompts = read_prompts(prompts_file, pair.target, chat) if prompts_file else []
    held_out = {}
    for value in held_out_sets:
        name, texts = held_out_set(value, pair.target, chat, cfg.eval_prompts)
        if name in held_out:
            raise DtrtError(f"--held-out {value}: a second set named {name!r}; give each set once")
        held_out[name] = texts
    state = train_drafter(
        pair.target,
        Path(out),
        cfg,
        corpus,
        prompts,
        resume,
        log=_log,
        progress=_progress,
        data_dirs=data_dirs,
        held_out=held_out,
    )
    if state:  # rank 0 of a torchrun
        click.echo(f"{out}: best held-out tau {state['best']:.2f} after {state['step']} steps")


@cli.command("drafter-data")
@click.option("--model", help=f"registry name of the target: {', '.join(names())}")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--model-dir", type=click.Path(), help=MODEL_DIR_HELP)
@click.option("--out", required=True, type=click.Path(), help="directory of shards and progress.json")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(),
    help="JSONL ({'prompt': ...}, {'turns': [...]} or {'messages': [...]}) or text lines: the target answers them",
)
@click.option("--corpus", multiple=True, type=click.Path(), help="text file or directory to teacher-force (repeat)")
@options_from(DataGenConfig, skip=("device",), decls={"chat": ("--chat/--no-chat",)})
@click.option("--resume", is_flag=True, help="continue the run in --out after its last finished shard")
@click.option("--max-shards", type=int, help="stop after writing this many shards (--resume continues)")
@click.option("--threads", type=int, help="intra-op threads of torch (default: torch's)")
@option_from(DataGenConfig, "device")
def drafter_data_cmd(model, target, model_dir, out, prompts_file, corpus, resume, max_shards, threads, **opts):
    """Write a drafter's training data as resumable shards: the target's own responses to prompts, and corpus rows."""
    import torch

    from dtrt.train.datagen import drafter_data

    if threads is not None:
        if threads < 1:
            raise DtrtError(f"--threads {threads}: must be >= 1")
        torch.set_num_threads(threads)
    cfg = DataGenConfig(**opts)
    check_cuda(cfg.device)
    spec = resolve_spec(model=model, target=target, model_dir=model_dir, backend="torch")
    pair = load_pair(spec, log=_log)
    progress = drafter_data(
        pair.target, Path(out), cfg, prompts_file, corpus, resume, spec.model or target, _log, max_shards
    )
    r, c = progress["responses"], progress["corpus"]
    rate = f" ({r['response_tokens'] / r['seconds']:.1f} tok/s)" if r["seconds"] else ""
    click.echo(
        f"{out}: {r['rows']} response rows from {r['done_units']}/{r['units']} (prompt, sample) pairs, "
        f"{r['response_tokens']:,} response tokens{rate}; {c['rows']} corpus rows, {c['tokens']:,} tokens"
    )


@cli.command("draft-vocab")
@click.option("--model", help=f"registry name of the pair: {', '.join(names())}")
@click.option("--target", type=click.Path(), help="target checkpoint directory")
@click.option("--drafter", type=click.Path(), help="drafter checkpoint directory (the subset is written beside it)")
@click.option("--model-dir", type=click.Path(), help=MODEL_DIR_HELP)
@click.option(
    "--data",
    "data_dirs",
    multiple=True,
    required=True,
    type=click.Path(),
    help="a `dtrt drafter-data` directory (repeat): its answer tokens are counted",
)
@click.option("--size", type=click.IntRange(min=1), required=True, help="tokens in the subset (e.g. 8192, 16384)")
@click.option("--out", type=click.Path(), help="the file to write (default: d2t.safetensors in the drafter directory)")
@click.option("--force", is_flag=True, help="replace an existing file")
def draft_vocab_cmd(model, target, drafter, model_dir, data_dirs, size, out, force):
    """Write a reduced draft vocabulary: the target's most frequent answer tokens, EOS and chat markup always kept."""
    from dtrt.models.config import generation_eos, read_json
    from dtrt.models.tokenizer import load_tokenizer
    from dtrt.train.draft_vocab import build_draft_vocab

    spec = resolve_spec(model=model, target=target, drafter=drafter, model_dir=model_dir, backend="torch")
    pair = load_pair(spec, log=_log)
    drafter_dir = pair.drafter_for(pair.domino is not None) if drafter is None else Path(drafter)
    if out is None and drafter_dir is None:
        raise DtrtError("--out: the pair has no drafter directory to write beside; pass --out FILE")
    out = Path(out) if out is not None else Path(drafter_dir) / "d2t.safetensors"
    if out.exists() and not force:
        raise DtrtError(f"--out {out}: already exists; pass --force to replace it")
    cfg = read_json(Path(pair.target) / "config.json")
    tokenizer = load_tokenizer(pair.target)
    eos = set(generation_eos(pair.target))
    eos |= {cfg["eos_token_id"]} if isinstance(cfg.get("eos_token_id"), int) else set(cfg.get("eos_token_id") or ())
    vocab, meta = build_draft_vocab(
        [Path(d) for d in data_dirs], pair.target, tokenizer, cfg["vocab_size"], sorted(eos), size
    )
    tokenizer_json = Path(pair.target) / "tokenizer.json"
    if tokenizer_json.is_file():
        from dtrt.artifacts.files import sha256

        meta["tokenizer_sha256"] = sha256(tokenizer_json)
    vocab.save(out, meta)
    click.echo(
        f"{out}: {vocab.size} of {vocab.vocab_size} tokens, covering {meta['coverage']:.2%} of "
        f"{meta['answer_tokens']:,} answer tokens ({meta['always_kept']} always kept)"
    )


def _progress(what):
    from tqdm import tqdm

    bar = {}

    def update(i, n, postfix=None):
        if "bar" not in bar:
            bar["bar"] = tqdm(total=n, desc=what, file=sys.stderr, leave=False, dynamic_ncols=True)
        b = bar["bar"]
        b.update(i - b.n)
        if postfix:
            b.set_postfix_str(postfix, refresh=False)
        if i >= n:
            b.close()

    return update


@cli.command()
@partial(source_options, quant_sweep=True)
@click.option(
    "--methods",
    help="comma list of methods (default: every one the pair serves); ar is always run; dominotree+lookup and "
    "cadominotree+lookup take prompt lookup's chains whatever --lookup says, so one run can hold both",
)
@click.option(
    "--datasets",
    "dataset_names",
    default="mt-bench,humaneval,math500,aime",
    show_default=True,
    help="comma list of mt-bench, humaneval, math500, aime, aime24, code-edit (HumanEval's functions, each with a "
    "small edit asked for: the answer copies its prompt), and the long-context summarisation datasets lexsum "
    "(Multi-LexSum) and essays (windows of Paul Graham's essays), run per --context-bins",
)
@click.option(
    "--context-bins",
    help="prompt lengths in tokens for lexsum and essays, e.g. 2048,4096,7168: prompts are cut by the target's "
    "tokenizer to fill each bin, chat template included (never padded: lexsum runs only the documents that fill a "
    "bin), one row per bin (essays/4k); default: 2K, 4K, 8K, ... that fit the context with --max-new-tokens, and "
    "the largest multiple of 1K that fits (smollm2-135m with --backend torch, 8192 positions: 2048,4096,7168; on "
    "its first-use ONNX Runtime export, 4096: 2048,3072)",
)
@click.option("--temperatures", default="0,1", show_default=True, help="comma list")
@click.option("--prompts", type=int, default=20, show_default=True, help="prompts per dataset (seeded subset)")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--budget", help=f"draft budget, or a sweep like 8,16,32 (default {budget_help()})")
@click.option("--seed", type=int, default=0, show_default=True, help="prompt subset and sampling seed")
@click.option("--quick", is_flag=True, help="2 prompts, 32 new tokens, the first temperature only")
@click.option(
    "--out",
    default="bench-results",
    show_default=True,
    type=click.Path(),
    help="directory for bench.json, bench.md, bench.png",
)
@click.option(
    "--cuda-graph",
    is_flag=True,
    help="with --device cuda: the dominotree rows replay drafting + tree building as one CUDA graph",
)
@click.option(
    "--lookup/--no-lookup",
    default=None,
    help=f"the dominotree and cadominotree rows named without +lookup also take prompt lookup's chains (default: "
    f"{lookup_help()})",
)
@click.option("--draft-vocab", help=DRAFT_VOCAB_HELP)
@click.option(
    "--gguf",
    type=click.Path(),
    help="GGUF of the same target for a llama.cpp peer row (needs llama-cpp-python; smollm2-135m finds its own)",
)
@click.option(
    "--peer-timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="seconds the llama.cpp peer may take per generation before its row is failed",
)
@click.option(
    "--resume",
    type=click.Path(),
    help="continue the interrupted run in this --out directory (its flags; flags given here must not change the grid)",
)
@thinking_option
def bench(**flags):
    """Time methods x datasets x temperatures in one process against AR; write a JSON, a table and a plot."""
    from click.core import ParameterSource

    from dtrt.bench.main import BenchOptions, resumed
    from dtrt.bench.main import bench as run_bench

    opts = BenchOptions(**flags)
    if opts.resume:
        ctx = click.get_current_context()
        given = {k for k in flags if k != "resume" and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
        opts = resumed(opts, given)
    path = run_bench(opts, _log)
    click.echo((path / "bench.md").read_text(), nl=False)
    _log(
        f"wrote {path / 'bench.json'}, {path / 'bench.md'}"
        f"{', ' + str(path / 'bench.png') if (path / 'bench.png').is_file() else ''}"
    )


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

    eng = build_engines(export_dir, out, BuildConfig(max_batch, opt_level), force, log=_log)
    size = sum(m["size"] for m in eng.manifest["files"].values())
    click.echo(f"{eng.path}: {len(eng.manifest['stages'])} plans, {size / 1e6:.1f} MB")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the report")
def doctor(as_json):
    """Report the backends, devices, TensorRT and plugin libraries available here, and why any is not."""
    from dtrt.engines.doctor import render, run_checks, to_json

    checks, backends = run_checks()
    click.echo(json.dumps(to_json(checks, backends)) if as_json else render(checks, backends))


def main():
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _log("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        _log("interrupted")
        sys.exit(130)
    except click.UsageError as e:  # a bad flag value: one line, like every other bad input
        _log(f"error: {e.format_message()} (see `{e.ctx.command_path if e.ctx else 'dtrt'} --help`)")
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DtrtError as e:
        _log(f"error: {e}")
        sys.exit(2)
    except BackendFault as e:  # not the user's input: one line, the traceback on request
        if os.environ.get("DTRT_TRACEBACK", "0").strip() not in ("", "0"):
            raise
        _log(f"fault: {e} (a backend failed on valid input; DTRT_TRACEBACK=1 shows the traceback)")
        sys.exit(1)

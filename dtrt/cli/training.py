"""The training commands: `dtrt drafter-data`, `dtrt train-drafter` and `dtrt draft-vocab`."""

from pathlib import Path

import click

from dtrt.cli.base import MODEL_DIR_HELP, cli, log_line, progress_bar
from dtrt.cli.options import option_from, options_from
from dtrt.errors import DtrtError
from dtrt.train.config import DataGenConfig, TrainConfig
from dtrt.zoo.registry import names


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
    from dtrt.launch import resolve_spec
    from dtrt.launch.start import check_cuda, load_pair
    from dtrt.train.trainer import train_drafter

    cfg = TrainConfig(**opts)
    check_cuda(cfg.device)
    pair = load_pair(resolve_spec(model=model, target=target, model_dir=model_dir, backend="torch"), log=log_line)
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
        log=log_line,
        progress=progress_bar,
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

    from dtrt.launch import resolve_spec
    from dtrt.launch.start import check_cuda, load_pair
    from dtrt.train.datagen import drafter_data

    if threads is not None:
        if threads < 1:
            raise DtrtError(f"--threads {threads}: must be >= 1")
        torch.set_num_threads(threads)
    cfg = DataGenConfig(**opts)
    check_cuda(cfg.device)
    spec = resolve_spec(model=model, target=target, model_dir=model_dir, backend="torch")
    pair = load_pair(spec, log=log_line)
    progress = drafter_data(
        pair.target, Path(out), cfg, prompts_file, corpus, resume, spec.model or target, log_line, max_shards
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
    from dtrt.launch import resolve_spec
    from dtrt.launch.start import load_pair
    from dtrt.models.config import generation_eos, read_json
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.train.draft_vocab import build_draft_vocab

    spec = resolve_spec(model=model, target=target, drafter=drafter, model_dir=model_dir, backend="torch")
    pair = load_pair(spec, log=log_line)
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

"""The measuring commands: `dtrt quality` (what a target configuration costs) and `dtrt bench` (speed)."""

import json
from functools import partial
from pathlib import Path

import click

from dtrt.cli.base import DRAFT_VOCAB_HELP, cli, log_line, source_options, thinking_option
from dtrt.models.quant_spec import QUANTS
from dtrt.zoo.registry import DEFAULT_MODEL, budget_help, lookup_help, names


@cli.command()
@click.option(
    "--model",
    help=f"registry model whose first-use ONNX Runtime exports to score against its fp32 PyTorch target: "
    f"{', '.join(names())} (default: {DEFAULT_MODEL})",
)
@click.option(
    "--quant",
    default="none,gguf,gguf-a8,int8,int4",
    show_default=True,
    help="comma list of target configurations (with --model): none (fp32), gguf, gguf-a8 (the GGUF file's own "
    "blocks at fp32 / int8 activations), int8, int4 as dtrt run runs them (int8 activations), int8-fp32act, "
    "int4-fp32act (fp32 activations; teacher-forced only)",
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
@click.option(
    "--threads", type=click.IntRange(min=1), help="intra-op threads (default: ONNX Runtime's; llama.cpp's row: 1)"
)
@click.option(
    "--gguf",
    type=click.Path(),
    help="GGUF of the same target for a llama.cpp row, shown beside the others and not gated (needs "
    "llama-cpp-python, the dtrt[llamacpp] extra; smollm2-135m finds its own)",
)
@click.option("--seed", type=int, default=0, show_default=True, help="which texts and prompts")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
def quality(
    model,
    quant,
    exports,
    datasets,
    texts,
    max_tokens,
    prompts,
    max_new_tokens,
    kernel_paths,
    threads,
    gguf,
    seed,
    as_json,
):
    """What a target configuration costs: teacher-forced agreement and NLL, free-running answers against the
    reference, and the quality gate's verdict (dtrt.zoo.gate)."""
    from dtrt.artifacts.export import load_export
    from dtrt.artifacts.kernel_path import EMULATED
    from dtrt.bench.contenders import find_gguf, render
    from dtrt.bench.datasets import load
    from dtrt.bench.main import split_list
    from dtrt.bench.quality import Candidate, config_candidate, held_out, parse_config, quality, table
    from dtrt.bench.quality_llamacpp import llamacpp_peer
    from dtrt.launch import resolve_spec
    from dtrt.launch.start import load_pair
    from dtrt.runtime.tokenizer import load_tokenizer

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

        fp32act = tuple(f"{q}-fp32act" for q in ("int8", "int4"))  # MatMulNBits at level 1; gguf names its own
        configs = split_list("--quant", quant, str, (*QUANTS, *fp32act))
        spec = resolve_spec(model=model or DEFAULT_MODEL, backend="torch", method="ar")
        pair = load_pair(spec, log_line)
        cands = []
        for name in configs:
            exp = cached_export(pair, spec.model, log_line, parse_config(name)[0])
            cands.append(config_candidate(name, str(exp.path)))
        reference = Candidate("torch fp32", target=str(pair.target))
        tokenizer = load_tokenizer(pair.target)
    names = [n.strip() for n in datasets.split(",") if n.strip()]
    items = [t for name in names for t in held_out(name, texts, seed)]
    asked = [(name, p.turns[0]) for name in names for p in (load(name, prompts, seed) if prompts else [])]
    rendered = [(name, render(tokenizer, [], turn)) for name, turn in asked]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    peer = llamacpp_peer(
        find_gguf(gguf, None if exports else model or DEFAULT_MODEL), threads=threads, eos=eos, log=log_line
    )
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
        peer=peer,
        log=log_line,
    )
    click.echo(json.dumps({"reference": reference.name, "rows": rows}) if as_json else table(rows, reference.name))


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
    "(Multi-LexSum) and essays (windows of Paul Graham's essays), run per --context-bins; or a prompts file of "
    'your own: JSONL, a line each, {"prompt": ...} or {"turns": [...]} with an optional "id", or plain text, a '
    "prompt a line (its rows are labelled with the path as given)",
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
    help="directory for bench.json (the command and the summary), bench.md, bench.png and the records "
    "(records.jsonl.xz)",
)
@click.option(
    "--cuda-graph",
    is_flag=True,
    help="with --device cuda: the dominotree rows replay drafting + tree building as one CUDA graph",
)
@click.option(
    "--graphs",
    default="eager",
    show_default=True,
    help="comma list of eager and captured: captured rows run with --static-shapes (on --device cuda each verify "
    "width is a CUDA graph, and the dominotree rows without lookup replay drafting as one too), each paired with its "
    "own AR; eager,captured times both side by side (torch backend)",
)
@click.option(
    "--compile/--no-compile",
    default=True,
    show_default=True,
    help="the captured rows on --device cuda run each decoder layer's parts around attention compiled by "
    "torch.compile, as `dtrt run --static-shapes` does (--no-compile: the captured graphs of the eager ops)",
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
    path = run_bench(opts, log_line)
    click.echo((path / "bench.md").read_text(), nl=False)
    log_line(
        f"wrote {path / 'bench.json'}, {path / 'bench.md'}"
        f"{', ' + str(path / 'bench.png') if (path / 'bench.png').is_file() else ''}, {path / 'records.jsonl.xz'}"
    )

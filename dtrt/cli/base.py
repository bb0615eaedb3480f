"""The command group, the one-line error handling of `main`, and what several commands share: help texts,
the source, method and request options, the log and progress lines.

Nothing here, nor in the modules that define the commands, imports torch: the flags are made from plain values
(RunSpec, ExportConfig, ...), so `--help` and a bad flag are answered in about 0.15 s. A command imports the
runtime once its flags are parsed (Command.invoke), then the rest of what it needs in its own body."""

import contextlib
import gc
import os
import sys

import click

from dtrt import __version__
from dtrt.artifacts.files import file_system_error
from dtrt.cli.options import FILLED_IN, option_from
from dtrt.errors import BackendFault, DtrtError
from dtrt.frontend.requests import has_chat_template
from dtrt.models.quant_spec import QUANTS
from dtrt.runtime.spec import RunSpec
from dtrt.zoo.registry import DEFAULT_MODEL, budget_help, lookup_help, method_help, names, quant_help

MODEL_DIR_HELP = "where registry checkpoints are looked up before the Hugging Face cache"
DRAFT_VOCAB_HELP = (
    "the vocabulary the drafter drafts from: full, or a subset file (dtrt draft-vocab); default: the drafter's own "
    "d2t.safetensors where it has one (an export: the one it was exported with; a model's first-use export: the "
    "registry's subset for its target, e.g. SmolLM2's 8K one on its int8 and int4 targets), else full"
)
QUANT_HELP = (
    "the target's linear layers, lm_head included, as weight-only int8 (per output channel) or int4 (per block); "
    "the quantized model is the target every method reproduces"
)


def log_line(msg):
    click.echo(msg, err=True)


@contextlib.contextmanager
def imports_uncollected():
    """Import with the cyclic garbage collector off, then keep what was imported out of its later passes. Importing
    torch makes about a million objects, and the collector's passes over them while they are made (three full ones)
    took a tenth of a second and more of a start that lasts two, freeing nothing worth it; frozen (gc.freeze), the
    modules and what they hold are never scanned again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


class Command(click.Command):
    """A command whose work starts from the launch layer: once its flags are parsed, dtrt.launch (with torch and the
    runtime under it) is imported without the collector's passes (imports_uncollected), where no process has it yet.
    `dtrt verify`, which only hashes files, is a plain click.Command and imports none of it."""

    def invoke(self, ctx):
        if "dtrt.launch" not in sys.modules:
            with imports_uncollected():
                import dtrt.launch  # noqa: F401
        return super().invoke(ctx)


class Group(click.Group):
    command_class = Command


@click.group(cls=Group)
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
            help=f"registry name: {', '.join(names())} (default {DEFAULT_MODEL} when no --target, --export or "
            "--engines is given)",
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
            help="Default: onnxruntime for the default model or an --export, tensorrt for --engines, torch for "
            "--model/--target.",
        ),
        click.option("--export", type=click.Path(), help="export directory (dtrt export): what onnxruntime runs"),
        click.option(
            "--engines",
            type=click.Path(),
            help="engine directory (dtrt build-engine) or the --out root it was given: what tensorrt runs (implies "
            "--backend tensorrt)",
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
        option_from(RunSpec, "static_shapes"),
        option_from(RunSpec, "compile", "--compile/--no-compile"),
        option_from(RunSpec, "lookup", "--lookup/--no-lookup", default=FILLED_IN, help=f"Default: {lookup_help()}."),
        option_from(RunSpec, "draft_vocab", replace_help=True, help=DRAFT_VOCAB_HELP),
        option_from(RunSpec, "prefix_cache_mb"),
        click.option("--no-prefix-cache", is_flag=True, help="restore no prompt prefix from earlier requests"),
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


def use_chat(pipe, chat: bool | None) -> bool:
    """--chat/--no-chat, by default the chat template when the tokenizer has one."""
    if chat and not has_chat_template(pipe.tokenizer):
        raise DtrtError(
            "--chat: this model's tokenizer has no chat template; drop --chat (the prompt is then used as raw text)"
        )
    return has_chat_template(pipe.tokenizer) if chat is None else chat


def progress_bar(what):
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


def main():
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        log_line("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        log_line("interrupted")
        sys.exit(130)
    except click.UsageError as e:  # a bad flag value: one line, like every other bad input
        log_line(f"error: {e.format_message()} (see `{e.ctx.command_path if e.ctx else 'dtrt'} --help`)")
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DtrtError as e:
        log_line(f"error: {e}")
        sys.exit(2)
    except OSError as e:
        line = file_system_error(e)
        if line is None:
            raise
        log_line(f"error: {line}")
        sys.exit(1)
    except BackendFault as e:  # not the user's input: one line, the traceback on request
        if os.environ.get("DTRT_TRACEBACK", "0").strip() not in ("", "0"):
            raise
        log_line(f"fault: {e} (a backend failed on valid input; DTRT_TRACEBACK=1 shows the traceback)")
        sys.exit(1)

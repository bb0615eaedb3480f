"""`dtrt run`: one prompt, a JSONL file of requests, or the interactive prompt, streamed as committed."""

import json
import sys
from dataclasses import replace

import click

from dtrt.cli.base import cli, log_line, method_options, request_options, source_options, thinking_option, use_chat
from dtrt.errors import DtrtError
from dtrt.frontend.requests import FLAGS, check_thinking, make_request, read_requests
from dtrt.frontend.terminal import generate_one, prompt_ids, repl, stats_line
from dtrt.launch import pipeline, resolve_spec


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
    pipe = pipeline(spec, log_line)
    chat = use_chat(pipe, chat)
    check_thinking(pipe.tokenizer, thinking)
    if interactive:
        log_line(f"dtrt run ({spec.method}): one prompt per line; Ctrl-C stops a generation, Ctrl-D quits")
        return repl(pipe, defaults, chat, truncate, input, lambda s: click.echo(s, nl=False), log_line)
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
        log_line(stats_line(c, spec.method))
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

"""`dtrt run`: one prompt, a JSONL file of requests, or the interactive prompt, streamed as committed. At a
terminal: one generation streamed as it is committed, Ctrl-C that ends a generation at its next round instead of
tearing it down mid-stage, and the interactive prompt loop."""

from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import click

from dtrt.cli.base import cli, log_line, method_options, request_options, source_options, thinking_option, use_chat
from dtrt.errors import DtrtError
from dtrt.frontend.requests import (
    FLAGS,
    Request,
    RequestError,
    check_thinking,
    has_chat_template,
    make_request,
    prompt_ids,
    read_requests,
)
from dtrt.runtime.request_values import ResponseFormat

if TYPE_CHECKING:
    from dtrt.frontend.text import Completion


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
@click.option(
    "--json-schema",
    type=click.Path(dir_okay=False),
    help="structured output: the output is JSON valid under this JSON schema file (needs the structured extra)",
)
@click.option("--json-object", is_flag=True, help="structured output: the output is one JSON object")
def run(prompt, max_new_tokens, temperature, top_p, seed, stop, chat, thinking, truncate, input_file, as_json, **flags):
    """Generate a continuation of PROMPT (or of standard input; an interactive prompt at a terminal)."""
    from dtrt.launch import pipeline, resolve_spec  # here, with torch: the flags and --help need neither
    from dtrt.runtime.grammar import compile_format

    fmt, flag = read_format(flags.pop("json_schema"), flags.pop("json_object"))
    defaults = make_request(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        thinking=thinking,
        names=FLAGS,
    )
    if fmt is not None:
        defaults = replace(defaults, response_format=fmt)
    spec = resolve_spec(**flags)
    if prompt is not None and input_file is not None:
        raise DtrtError("PROMPT and --input exclude each other: pass one")
    requests = read_requests(input_file, defaults) if input_file is not None else None
    interactive = prompt is None and requests is None and sys.stdin.isatty()
    if prompt is None and requests is None and not interactive:
        prompt = sys.stdin.read()
    if requests is None and not interactive and spec.prefix_cache_mb is None:
        spec = replace(spec, prefix_cache_mb=0)  # one prompt: no later generation reads a snapshot of it
    pipe = pipeline(spec, log_line)
    if fmt is not None:
        compile_format(fmt, pipe.tokenizer, flag)  # a bad schema: one line naming the flag, before generating
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
        log_line(stats_line(c, spec.label))
    if c.stop_reason == "cancelled":
        sys.exit(130)


def _run_jsonl(pipe, requests, chat, truncate, source):
    """Every line is encoded and fitted before the first generation, so a bad line stops the run before any output."""
    from dtrt.runtime.grammar import compile_format

    prepared = []
    for line, rid, req in requests:
        try:
            prepared.append((rid, req, prompt_ids(pipe, req, chat, truncate)))
            if req.response_format is not None:  # a bad schema stops the run before any output too
                compile_format(req.response_format, pipe.tokenizer)
        except DtrtError as e:
            raise DtrtError(f"{source}:{line}: {e}") from None
    for rid, req, ids in prepared:
        c = generate_one(pipe, req, ids)
        click.echo(json.dumps(({} if rid is None else {"id": rid}) | c.to_json(pipe.spec)))
        if c.stop_reason == "cancelled":
            sys.exit(130)
        pipe.remember(ids + c.tokens)  # a later line that continues this conversation restores them


NEW_CHAT = "/new"


class Interrupt:
    """While active, Ctrl-C (SIGINT) only sets a flag (call the object to read it); a second Ctrl-C raises
    KeyboardInterrupt as usual. Outside the main thread, where signals cannot be caught, it never fires."""

    def __init__(self):
        self.hit = False
        self._old = None

    def __enter__(self):
        self.hit = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return False

    def __call__(self) -> bool:
        return self.hit


def stats_line(c: Completion, label: str) -> str:
    """The line on standard error after an answer; `label`: what ran (RunSpec.label: `dominotree+lookup@2`)."""
    out = c.generation
    end = "" if c.stop_reason in ("eos", "length") else f"  ({c.stop_reason})"
    return (
        f"[{label}] tau {out.tau:.2f}  {out.tokens_per_s:.1f} tok/s  {len(out.tokens)} tokens  "
        f"{len(out.rounds)} rounds  prefill {out.prefill_s * 1e3:.0f} ms{end}"
    )


def generate_one(pipe, req: Request, ids: list[int], write=None) -> Completion:
    """One generation with `write(text)` streaming it; Ctrl-C ends it with stop_reason "cancelled"."""
    from dtrt.frontend.text import complete
    from dtrt.runtime.grammar import compile_format

    with Interrupt() as interrupted:
        grammar = None if req.response_format is None else compile_format(req.response_format, pipe.tokenizer)
        return complete(pipe, ids, req.max_new_tokens, req.sampling, req.stop, write, interrupted, grammar=grammar)


def read_format(json_schema: str | None, json_object: bool) -> tuple[ResponseFormat | None, str]:
    """--json-schema FILE (a JSON schema, or OpenAI's {"name", "schema", "strict"} around one) or --json-object, and
    the flag that gave it."""
    if json_schema is not None and json_object:
        raise DtrtError("--json-schema and --json-object exclude each other: pass one")
    if json_object:
        return ResponseFormat("json_object"), "--json-object"
    if json_schema is None:
        return None, "--json-schema"
    try:
        with open(json_schema) as f:
            schema = json.load(f)
    except OSError as e:
        raise DtrtError(f"--json-schema {json_schema}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise DtrtError(
            f"--json-schema {json_schema}: not JSON ({e.msg} at line {e.lineno}); give a JSON schema"
        ) from None
    if not isinstance(schema, dict):
        raise DtrtError(f"--json-schema {json_schema}: a JSON schema is an object, not {type(schema).__name__}")
    if isinstance(schema.get("schema"), dict) and "name" in schema:  # OpenAI's json_schema object
        return ResponseFormat("json_schema", schema["schema"], schema["name"], schema.get("strict")), "--json-schema"
    return ResponseFormat("json_schema", schema), "--json-schema"


def repl(pipe, defaults: Request, chat: bool, truncate: bool, read_line, write, log):
    """One prompt per line, each generated and streamed in turn. Through the chat template the lines are one
    conversation: each prompt carries the earlier turns and replies (the oldest dropped when they no longer fit,
    `/new` starts over); raw prompts (--no-chat, or no template) stand alone. Ctrl-C during a generation ends it
    and returns to the prompt; Ctrl-D or Ctrl-C at the prompt ends the loop. `read_line(prompt)` is `input` at a
    terminal."""
    history: list[dict] | None = [] if chat and has_chat_template(pipe.tokenizer) else None
    while True:
        try:
            line = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if not line.strip():
            continue
        if history is not None and line.strip() == NEW_CHAT:
            history.clear()
            log("(new conversation)")
            continue
        try:
            req, ids = _turn(pipe, defaults, line, history, chat, truncate, log)
            c = generate_one(pipe, req, ids, write)
        except DtrtError as e:
            log(f"error: {e}")
            continue
        write("\n")
        log(stats_line(c, pipe.spec.label))
        if history is not None:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": c.text}]
            try:
                pipe.remember(ids + c.tokens)  # while the next line is typed: its prompt restores them
            except KeyboardInterrupt:  # nothing is kept; the next generation starts from a reset
                pass


def _turn(pipe, defaults: Request, line: str, history: list[dict] | None, chat: bool, truncate: bool, log):
    """The request of one interactive line and its prompt ids, dropping the oldest exchanges that do not fit."""
    if history is None:
        req = replace(defaults, prompt=line)
        return req, prompt_ids(pipe, req, chat, truncate)
    user = {"role": "user", "content": line}
    for start in range(0, len(history) + 1, 2):
        req = replace(defaults, messages=[*history[start:], user])
        try:
            ids = prompt_ids(pipe, req, chat, truncate=False)
        except RequestError:
            if start == len(history):  # the line alone does not fit
                return req, prompt_ids(pipe, req, chat, truncate)
            continue
        if start:
            log(f"(the {start // 2} oldest exchanges no longer fit the context and were dropped)")
            del history[:start]
        return req, ids

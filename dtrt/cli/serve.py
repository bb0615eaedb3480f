"""`dtrt serve`: the flags of the OpenAI-compatible server; dtrt.serve.main serves."""

from dataclasses import fields

import click

from dtrt.cli.base import cli, log_line, method_options, request_options, source_options, thinking_option
from dtrt.cli.options import option_from
from dtrt.frontend.requests import make_request
from dtrt.serve.config import ServeConfig


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
    "directory the target, or the --export or --engines, comes from)",
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
    from dtrt.launch import resolve_spec
    from dtrt.serve.main import serve as run_server

    replicas = {k: flags.pop(k) for k in ("replicas", "max_replicas", "ray_address")}
    cfg = {f.name: flags.pop(f.name) for f in fields(ServeConfig) if f.name in flags}
    spec = resolve_spec(**flags)
    defaults = make_request(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, thinking=thinking
    )
    cfg = ServeConfig("", defaults, truncate=truncate, **cfg)
    run_server(spec, cfg, host=host, port=port, name=name, thinking=thinking, log=log_line, **replicas)

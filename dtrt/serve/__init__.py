"""`dtrt serve`: the OpenAI-compatible HTTP server (needs the `serve` extra: pip install "dtrt[serve]"); its replicas
on Ray Serve (dtrt.serve.replicas) need the `ray` extra as well."""

from dtrt.serve.server import BackgroundServer, ServeConfig, ServeError, Server, serve_forever

__all__ = ["BackgroundServer", "ServeConfig", "ServeError", "Server", "serve_forever"]

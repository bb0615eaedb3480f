"""`dtrt serve`: the OpenAI-compatible HTTP server (needs the `serve` extra: pip install "dtrt[serve]")."""

from dtrt.serve.server import BackgroundServer, ServeConfig, Server, serve_forever

__all__ = ["BackgroundServer", "ServeConfig", "Server", "serve_forever"]

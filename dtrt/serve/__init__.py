"""`dtrt serve`: the OpenAI-compatible HTTP server (needs the `serve` extra: pip install "dtrt[serve]"); its replicas
on Ray Serve (dtrt.serve.replicas) need the `ray` extra as well.

The server's names load on first access, so that importing the package (the CLI does, for `dtrt serve`'s flags)
needs no aiohttp: only serving does."""

__all__ = ["BackgroundServer", "ServeConfig", "ServeError", "Server", "serve_forever"]


def __getattr__(name: str):
    if name in __all__:
        from dtrt.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'dtrt.serve' has no attribute {name!r}")

"""The `dtrt` command line: each command parses its flags, resolves a RunSpec once (dtrt.launch), opens the
pipeline and hands it to the runtime, the server or the bench. One module per command family; the group, the
shared options and `main` are in dtrt.cli.base."""

from dtrt.cli import artifacts, measure, run, serve, training  # noqa: F401  (each registers its commands)
from dtrt.cli.base import cli, main

__all__ = ["cli", "main"]

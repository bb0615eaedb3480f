"""The `dtrt` command: the process's memory set up first (dtrt.hugepages), then the command line (dtrt.cli).

Imports nothing heavy before deciding, so that starting again costs an interpreter's start, not torch's import."""

import os
import sys

from dtrt import hugepages


def restart():
    """Start this process again, same interpreter and arguments, with glibc's huge-page tunable where
    dtrt.hugepages wants it; return where it does not (or where the process cannot start again)."""
    value = hugepages.here_tunables()
    if value is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": value})
    except OSError:
        pass  # an interpreter that cannot be started again by path: run as it is


def main():
    restart()
    from dtrt.cli import main as cli_main

    cli_main()

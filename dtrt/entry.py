"""The `dtrt` command: the process's memory set up first (dtrt.hugepages), then the command line (dtrt.cli, which
imports torch only once a command's flags are parsed), then an exit that leaves out the interpreter's teardown
(leave).

Imports nothing heavy before deciding, so that starting again costs an interpreter's start, not torch's import."""

import atexit
import os
import sys
import threading
from typing import NoReturn

from dtrt import hugepages

FLUSH_FAILED = 120
"""The exit status where stdout or stderr cannot be flushed at the end (a reader gone), as Python's own exit gives."""


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

    try:
        cli_main()
    except SystemExit as e:
        leave(e.code)
    leave(0)


def leave(code) -> NoReturn:
    """Exit with `code` (a SystemExit's: None, a number, or a message for stderr and status 1) as Python's exit
    would, less the interpreter's teardown: a process that imported torch spends about half a second clearing its
    modules after the command's output is complete. What Python's exit does that a user can observe is done here, in
    its order: the threads that are not daemons are joined (a kernel compile still running; Ctrl-C ends the wait with
    status 130), the atexit functions run (temporary folders, logging, child processes), and stdout and stderr are
    flushed. A traceback never comes here: it takes Python's own exit."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    me = threading.current_thread()
    try:
        while waiting := [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]:
            for t in waiting:  # again until none is left: a thread may start another
                t.join()
    except KeyboardInterrupt:  # Ctrl-C while waiting: end now, as an interrupted command does
        status = 130
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe, or a stream closed by the command
            status = status or FLUSH_FAILED
    os._exit(status)

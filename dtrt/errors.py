"""The two kinds of failure dtrt reports.

DtrtError: the user's mistake (a bad flag, file or request). The message names what is wrong and what to do; the
CLI prints it as one line (exit 2) and the server answers 400.
BackendFault: something failed inside a backend while running a stage that was given valid inputs (a runtime
library error, a device fault). It is not the user's to fix by changing the request: the CLI prints one line
(exit 1, the traceback with DTRT_TRACEBACK=1) and the server answers 500 and logs the traceback.
"""


def first_line(e: BaseException) -> str:
    """An exception as one line for a one-line message: its class and the first line of its text."""
    text = str(e).strip()
    return f"{e.__class__.__name__}: {text.splitlines()[0][:160]}" if text else e.__class__.__name__


class DtrtError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits non-zero."""


class BackendFault(RuntimeError):
    """A failure inside a backend (ONNX Runtime, TensorRT, a device) on inputs the contract allows."""

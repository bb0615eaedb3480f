"""llama.cpp's weight repacking (its "extra buffer types"), and when the peer runs without it.

llama.cpp places Q4_0/Q4_1/Q8_0 weights in AMX buffers when CPUID reports AMX. Some virtual machines report AMX
and do not run it: the first product there dies of an illegal instruction (SIGILL), or of a segmentation fault
(SIGSEGV, llama-cpp-python 0.3.36 on a 2-core Xeon VM). A peer process that dies so with repacking on (of SIGILL on
any CPU, of SIGSEGV where CPUID reports AMX) is started again with repacking off (llama.cpp's `--no-repack`); the
peer's weights then stay in the GGUF's own layout, which every x86-64 CPU llama.cpp was built for runs."""

import importlib
import inspect
import signal
from pathlib import Path

from dtrt.errors import DtrtError

NO_REPACK = "--no-repack"  # the peer child's flag (dtrt.bench.peer_llamacpp, dtrt.bench.quality_llamacpp)
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


def cpuid_amx(cpuinfo: str | None = None) -> list[str]:
    """The AMX flags CPUID reports (/proc/cpuinfo's, or `cpuinfo`'s text); [] where it has none or cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return [f for f in AMX_FLAGS if f in flags]


DEATHS = {signal.SIGILL: "an illegal instruction (SIGILL)", signal.SIGSEGV: "a segmentation fault (SIGSEGV)"}


def retry_command(command: list[str], returncode: int | None, *, cpuinfo: str | None = None) -> list[str] | None:
    """The peer's command again with repacking off, where it died with repacking on of SIGILL, or of SIGSEGV on a CPU
    whose CPUID reports AMX (/proc/cpuinfo's flags, or `cpuinfo`'s); else None."""
    if NO_REPACK in command or returncode is None:
        return None
    if returncode == -signal.SIGILL or (returncode == -signal.SIGSEGV and cpuid_amx(cpuinfo)):
        return [*command, NO_REPACK]
    return None


def retry_line(label: str, returncode: int, cpuinfo: str | None = None) -> str:
    """The log line of a retry with repacking off."""
    amx = cpuid_amx(cpuinfo)
    why = f"CPUID reports AMX ({' '.join(amx)}), which this machine does not run" if amx else "no AMX in CPUID"
    return (
        f"{label} died of {DEATHS[signal.Signals(-returncode)]} with its weight repacking on ({why}); "
        f"starting it again with repacking off (llama.cpp's --no-repack)"
    )


REPACK_OFF = "weight repacking off (it died with repacking on)"
"""What the bench's machine line and dtrt quality's row say of a peer that runs with repacking off."""


def open_llama(llama_class, path: str, *, repack: bool, **kwargs):
    """llama_class(model_path=path, **kwargs) with llama.cpp's repacking on or off. llama-cpp-python 0.3 has no
    keyword for it: its model parameters come from llama_model_default_params(), whose `use_extra_bufts` is turned
    off while the model loads."""
    if repack:
        return llama_class(model_path=path, **kwargs)
    if "use_extra_bufts" in inspect.signature(llama_class).parameters:
        return llama_class(model_path=path, use_extra_bufts=False, **kwargs)
    lib = importlib.import_module("llama_cpp.llama_cpp")
    if "use_extra_bufts" not in dict(lib.llama_model_params._fields_):
        raise DtrtError(
            "llama-cpp-python: this version cannot turn llama.cpp's weight repacking off (no use_extra_bufts); "
            "upgrade it: pip install -U llama-cpp-python"
        )
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        return llama_class(model_path=path, **kwargs)
    finally:
        lib.llama_model_default_params = default

"""Transparent huge pages for the host memory the CPU backends stream their weights from.

At batch 1 a CPU step reads every weight once, from memory the previous step has pushed out of the caches, in 4 KiB
pages: a TLB miss every 4 KiB, and the hardware prefetchers stop at each page's end. glibc's malloc asks the
kernel for 2 MiB pages when its `glibc.malloc.hugetlb=1` tunable is set (glibc 2.35 on, Linux with transparent huge
pages in `madvise` or `always` mode). A tunable is read when the process starts, so the `dtrt` command sets it and
starts itself again before anything is allocated (dtrt.entry); `DTRT_HUGE_PAGES=0` leaves the process as it is.
Only speed changes: the same weights, the same kernels, the same tokens.
"""

import os
import platform
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
MIN_GLIBC = (2, 35)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wanted(environ) -> bool:
    return environ.get("DTRT_HUGE_PAGES", "1").strip() != "0"


def glibc() -> tuple[int, ...] | None:
    """The C library's version where it is glibc, else None."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word of `enabled`), or None where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def blocker(environ, *, system: str, libc: tuple[int, ...] | None, mode: str | None) -> str:
    """Why this process cannot or should not get glibc's huge-page advice ("" when it can)."""
    if not wanted(environ):
        return "turned off (DTRT_HUGE_PAGES=0)"
    if system != "Linux":
        return f"not on {system}"
    if libc is None or libc < MIN_GLIBC:
        return f"the C library is not glibc {'.'.join(map(str, MIN_GLIBC))} or later"
    if mode not in ("always", "madvise"):
        return f"the kernel's transparent huge pages are {mode or 'absent'}"
    return ""


def tunables(environ, *, system: str, libc: tuple[int, ...] | None, mode: str | None) -> str | None:
    """GLIBC_TUNABLES for a process started again with huge pages, or None where it should start as it is: where
    blocker() says why, or where GLIBC_TUNABLES already names the tunable (the user's value stands, and a process
    started again does not start a third time)."""
    current = environ.get("GLIBC_TUNABLES", "")
    if blocker(environ, system=system, libc=libc, mode=mode) or TUNABLE in current:
        return None
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def here_tunables(environ=None) -> str | None:
    environ = os.environ if environ is None else environ
    return tunables(environ, system=platform.system(), libc=glibc(), mode=thp_mode())


def resident_mib() -> float | None:
    """This process's anonymous memory in huge pages, MiB (None where the kernel does not say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe() -> str:
    """One line for a bench's machine line: what pages this process's weights lie in, and why."""
    huge = resident_mib()
    if huge:
        return f"{huge:.0f} MiB in transparent huge pages"
    why = blocker(os.environ, system=platform.system(), libc=glibc(), mode=thp_mode())
    if not why and TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        why = "started without the dtrt command"
    return f"4 KiB pages ({why or 'none granted'})"

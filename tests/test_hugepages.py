"""The `dtrt` command's huge pages (dtrt.hugepages, dtrt.entry): when it starts itself again with glibc's tunable,
what it keeps of the user's environment, and what a bench says of the pages its weights lay in."""

import os
import subprocess
import sys

import pytest

from dtrt import hugepages
from dtrt.bench import machine

LINUX = dict(system="Linux", libc=(2, 36), mode="madvise")


def test_tunable_added_on_linux_with_glibc_and_thp():
    assert hugepages.tunables({}, **LINUX) == "glibc.malloc.hugetlb=1"
    assert hugepages.tunables({}, **{**LINUX, "mode": "always"}) == "glibc.malloc.hugetlb=1"


def test_users_tunables_kept_and_theirs_for_hugetlb_stands():
    env = {"GLIBC_TUNABLES": "glibc.malloc.check=0"}
    assert hugepages.tunables(env, **LINUX) == "glibc.malloc.check=0:glibc.malloc.hugetlb=1"
    # already named (by the user, or by the first start): the process runs as it is, so it never restarts twice
    assert hugepages.tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, **LINUX) is None
    assert hugepages.tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, **LINUX) is None


@pytest.mark.parametrize(
    "env, system, libc, mode, why",
    [
        ({"DTRT_HUGE_PAGES": "0"}, "Linux", (2, 36), "madvise", "turned off (DTRT_HUGE_PAGES=0)"),
        ({}, "Darwin", None, None, "not on Darwin"),
        ({}, "Linux", None, "madvise", "the C library is not glibc 2.35 or later"),
        ({}, "Linux", (2, 31), "madvise", "the C library is not glibc 2.35 or later"),
        ({}, "Linux", (2, 36), "never", "the kernel's transparent huge pages are never"),
        ({}, "Linux", (2, 36), None, "the kernel's transparent huge pages are absent"),
    ],
)
def test_no_restart_where_huge_pages_cannot_or_should_not_be(env, system, libc, mode, why):
    assert hugepages.blocker(env, system=system, libc=libc, mode=mode) == why
    assert hugepages.tunables(env, system=system, libc=libc, mode=mode) is None


def test_thp_mode_is_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_MODE", f)
    assert hugepages.thp_mode() == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode() == "always"
    monkeypatch.setattr(hugepages, "THP_MODE", tmp_path / "missing")
    assert hugepages.thp_mode() is None


def _restarted(env: dict) -> str:
    code = "from dtrt.entry import restart; restart(); import os; print(os.environ.get('GLIBC_TUNABLES'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DTRT_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(hugepages.here_tunables({}) is None, reason="this machine gives no huge pages through glibc")
def test_the_process_starts_again_with_the_tunable_and_only_once():
    assert _restarted({}) == "glibc.malloc.hugetlb=1"
    assert _restarted({"GLIBC_TUNABLES": "glibc.malloc.check=0"}) == "glibc.malloc.check=0:glibc.malloc.hugetlb=1"
    assert _restarted({"DTRT_HUGE_PAGES": "0"}) == "None"


def test_describe_says_what_pages_and_why(monkeypatch):
    monkeypatch.setattr(hugepages, "resident_mib", lambda: 384.0)
    assert hugepages.describe() == "384 MiB in transparent huge pages"
    monkeypatch.setattr(hugepages, "resident_mib", lambda: 0.0)
    monkeypatch.setenv("DTRT_HUGE_PAGES", "0")
    assert hugepages.describe() == "4 KiB pages (turned off (DTRT_HUGE_PAGES=0))"
    monkeypatch.delenv("DTRT_HUGE_PAGES")
    if hugepages.here_tunables({}) is not None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
        assert hugepages.describe() == "4 KiB pages (started without the dtrt command)"


def test_bench_machine_line_names_the_host_memory():
    m = {**machine.cpu(), "host_memory": "384 MiB in transparent huge pages"}
    line = machine.describe(machine.hygiene(m, {"onnxruntime": 1}, 0.0, 1.0))
    assert "; host memory: 384 MiB in transparent huge pages;" in line

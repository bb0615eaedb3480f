"""The `dtrt` command's exit (dtrt.entry.leave): what Python's exit does that a user can observe is still done,
the interpreter's teardown is not, and the status is the command's."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# stdout buffered as a pipe's is by default, so that what is written before leave is still in Python's buffer
BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def _leave(body: str) -> subprocess.CompletedProcess:
    code = "from dtrt.entry import leave\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=BUFFERED)


def test_output_threads_and_atexit_are_done_and_the_teardown_is_not(tmp_path):
    done = tmp_path / "compiled"
    out = _leave(f"""
        import atexit, sys, threading, time
        from pathlib import Path

        class Teardown:
            def __del__(self):
                print("finalized", flush=True)

        kept = Teardown()  # a module global: only the interpreter's teardown deletes it
        threading.Thread(target=lambda: (time.sleep(0.3), Path({str(done)!r}).write_text("ok"))).start()
        atexit.register(lambda: print("atexit ran", file=sys.stderr))
        sys.stdout.write("x" * 5000)  # less than Python's buffer: still in it when leave is called
        leave(3)
        """)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "x" * 5000  # no "finalized": the teardown was left out
    assert out.stderr == "atexit ran\n"
    assert done.read_text() == "ok"  # the thread that is not a daemon finished before the exit


@pytest.mark.parametrize("code, status, err", [(None, 0, ""), (0, 0, ""), (2, 2, ""), ("no model", 1, "no model\n")])
def test_the_status_is_the_one_system_exit_gives(code, status, err):
    out = _leave(f"leave({code!r})")
    assert (out.returncode, out.stderr) == (status, err)


def test_a_reader_gone_is_status_120_and_no_traceback():
    code = "import sys; from dtrt.entry import leave; sys.stdout.write('x' * 100); leave(0)"  # flushed in leave
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=BUFFERED)
    p.stdout.close()  # the reader is gone before anything is read
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 120
    assert err == ""


def test_ctrl_c_while_a_thread_is_waited_for_ends_the_wait_with_status_130():
    code = textwrap.dedent("""
        import threading, time
        from dtrt.entry import leave
        threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: leave waits for it
        print("waiting", flush=True)
        leave(0)
        """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "waiting\n"
    time.sleep(1)  # into leave's wait
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 130
    assert p.stderr.read() == ""


def test_the_command_line_exits_through_leave_with_its_status():
    code = "import sys; sys.argv = ['dtrt', *sys.argv[1:]]; from dtrt.entry import main; main()"
    run = [sys.executable, "-c", code]
    ok = subprocess.run([*run, "run", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "Usage: dtrt run" in ok.stdout
    bad = subprocess.run([*run, "run", "--budget", "x", "hi"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: Invalid value for '--budget'") and bad.stderr.count("\n") == 1

"""Errors by kind (dtrt.errors): a user's error (DtrtError) is one line and exit 2 on the CLI, HTTP 400 from the
server; a failure inside a backend (BackendFault) is one line and exit 1 (the traceback with DTRT_TRACEBACK=1),
HTTP 500 from the server with the traceback in its log, and the server goes on serving."""

import asyncio
import json

import pytest
import torch
from helpers import pipe_for, run_cli, spec

from dtrt.errors import BackendFault, DtrtError
from dtrt.runtime.backends.onnxruntime import OrtRunner

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The cat sees "


def boom(self, stage, feeds):
    raise RuntimeError("boom\nsecond line of the library's message")


def ort_run(monkeypatch, capsys, export, *args):
    args = ("run", "--backend", "onnxruntime", "--export", str(export), "--max-new-tokens", "8", *args, PROMPT)
    return run_cli(monkeypatch, capsys, *args)


# the CLI


@pytest.mark.parametrize("traceback", [None, "", "0"])
def test_backend_fault_is_one_line_and_exit_1(tiny_export, monkeypatch, capsys, traceback):
    if traceback is None:
        monkeypatch.delenv("DTRT_TRACEBACK", raising=False)
    else:
        monkeypatch.setenv("DTRT_TRACEBACK", traceback)
    monkeypatch.setattr(OrtRunner, "run", boom)
    code, out, err = ort_run(monkeypatch, capsys, tiny_export.path)
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("fault: stage target: onnxruntime failed to run it (RuntimeError: boom)")
    assert "DTRT_TRACEBACK=1" in err and "Traceback" not in err and "second line" not in err


def test_backend_fault_traceback_on_request(tiny_export, monkeypatch, capsys):
    monkeypatch.setenv("DTRT_TRACEBACK", "1")
    monkeypatch.setattr(OrtRunner, "run", boom)
    with pytest.raises(BackendFault, match="^stage target: onnxruntime failed to run it") as e:
        ort_run(monkeypatch, capsys, tiny_export.path)
    assert isinstance(e.value.__cause__, RuntimeError) and str(e.value.__cause__).startswith("boom")


def test_user_error_is_one_line_and_exit_2(tiny_export, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DTRT_TRACEBACK", "1")  # a user's error never shows a traceback
    code, out, err = ort_run(monkeypatch, capsys, tmp_path / "missing")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / 'missing'}: export directory not found")
    code, out, err = ort_run(monkeypatch, capsys, tiny_export.path, "--max-new-tokens", "600")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "--max-context" in err


def test_the_runner_wraps_only_library_errors(tiny_export):
    """StageRunner turns the runtime library's exceptions into BackendFault; its own errors stay as they are."""
    from dtrt.runtime.backends.onnxruntime import OrtBackend

    runner = OrtBackend(tiny_export, "domino", threads=1).runner
    cache = dict(past_k=torch.zeros(4, 2, 1, 24), past_v=torch.zeros(4, 2, 1, 24), past_positions=torch.arange(0))
    feeds = dict(ids=[1], positions=[0], mask=[[True]], **cache)
    assert runner("target", **feeds)["logits"].shape == (1, 128)
    with pytest.raises(BackendFault, match=r"^stage target: onnxruntime failed to run it \(\w+"):
        runner("target", **(feeds | {"past_k": torch.zeros(4, 2, 1, 23)}))  # a shape ONNX Runtime rejects
    for err in (DtrtError("a user's error"), BackendFault("already a fault")):

        def raising(self, stage, feeds, err=err):
            raise err

        runner.run = raising.__get__(runner)
        with pytest.raises(type(err)) as e:
            runner("target", **feeds)
        assert e.value is err


# the server


@pytest.fixture(scope="module")
def own_pipe(tiny):
    """A pipeline of this module's own, whose backend the tests break for one request."""
    return pipe_for(tiny, spec("dominotree"))


@pytest.fixture(scope="module")
def logged_server(own_pipe):
    """The server (needs aiohttp) with its log kept."""
    pytest.importorskip("aiohttp")
    from dtrt.serve import BackgroundServer, ServeConfig

    logs = []
    with BackgroundServer(own_pipe, ServeConfig("tiny"), log=logs.append) as s:
        yield s, logs


async def post(url, body):
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url, json=body) as r:
            if body.get("stream") and r.status == 200:
                return r.status, await r.text()
            return r.status, await r.json(content_type=None)


def complete(server, **body):
    return asyncio.run(post(f"{server.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 8} | body))


def break_backend(monkeypatch, pipe, err):
    def failing(*args, **kwargs):
        raise err

    monkeypatch.setattr(pipe.backend, "target_forward", failing)


@pytest.mark.parametrize("stream", [False, True])
def test_backend_fault_answers_500_and_serving_goes_on(own_pipe, logged_server, monkeypatch, stream):
    server, logs = logged_server
    status, body = complete(server)
    assert status == 200
    good = body["choices"][0]["text"]

    logs.clear()
    with monkeypatch.context() as m:
        break_backend(m, own_pipe, BackendFault("stage target: onnxruntime failed to run it (RuntimeError: boom)"))
        status, body = complete(server, stream=stream)
    assert status == 500, body
    assert body["error"]["type"] == "server_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "stage target: onnxruntime failed to run it (RuntimeError: boom)" in body["error"]["message"]
    assert "Traceback" not in json.dumps(body)
    log = "\n".join(logs)
    assert "BackendFault" in log and "boom" in log and "Traceback" in log

    status, body = complete(server)
    assert status == 200 and body["choices"][0]["text"] == good


def test_bug_answers_500_without_its_message(own_pipe, logged_server, monkeypatch):
    server, logs = logged_server
    logs.clear()
    with monkeypatch.context() as m:
        break_backend(m, own_pipe, KeyError("internal detail"))
        status, body = complete(server)
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "KeyError" in body["error"]["message"] and "internal detail" not in body["error"]["message"]
    assert "Traceback" in "\n".join(logs)
    assert complete(server)[0] == 200


def test_user_error_during_generation_answers_400(own_pipe, logged_server, monkeypatch):
    server, logs = logged_server
    with monkeypatch.context() as m:
        break_backend(m, own_pipe, DtrtError("this request cannot be served: shorten it"))
        status, body = complete(server)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "this request cannot be served: shorten it"
    assert complete(server)[0] == 200


def test_backend_fault_mid_stream_ends_it_with_an_error_event(own_pipe, logged_server, monkeypatch):
    """After the headers went out (200), a fault is the stream's last event, without [DONE]."""
    server, logs = logged_server
    logs.clear()
    real = own_pipe.backend.target_forward
    calls = []

    def fails_after_the_prefill(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise BackendFault("stage target: onnxruntime failed to run it (RuntimeError: boom)")
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(own_pipe.backend, "target_forward", fails_after_the_prefill)
        status, text = complete(server, stream=True, max_tokens=32)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert "data: [DONE]" not in text and len(events) >= 2
    assert events[0]["choices"][0]["text"]  # the prefill's token went out
    assert events[-1]["error"]["type"] == "server_error" and "boom" in events[-1]["error"]["message"]
    assert "Traceback" in "\n".join(logs)
    assert complete(server)[0] == 200

"""`dtrt serve` on loopback: responses (streaming and not) equal `dtrt run`'s at T=0, 32 concurrent clients each get
their own complete responses, the queue limit (429), request timeouts (504), cancellation on disconnect, graceful
shutdown in-process and by SIGTERM. Every server here stops by itself; every client loop is bounded."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from dtrt.frontend.requests import Request, encode
from dtrt.frontend.text import complete
from dtrt.runtime.sampling import SamplingConfig

aiohttp = pytest.importorskip("aiohttp")
from helpers import pipe_for, run_cli, spec  # noqa: E402
from test_run_cli import PROMPT, a_stop_word, tiny_chat  # noqa: E402,F401 (fixture)

from dtrt.serve import BackgroundServer, ServeConfig  # noqa: E402 (needs aiohttp)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "The cat sees ",
    "A quick fox ",
    "Every king walks ",
    "The moon is very ",
    "Some old man reads ",
    "The dog ",
    "A small city ",
    "Far away ",
]
LONG = 4000  # new tokens no test waits for: generations that long are cancelled, timed out or rejected
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def ar_pipe(tiny):
    """Plain decoding: one token per round, so a long generation stays long."""
    return pipe_for(tiny, spec("ar"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def post(session, url, body=None, data=None):
    """(status, JSON body) of one non-streaming request."""
    async with session.post(url, json=body if data is None else None, data=data) as r:
        return r.status, await r.json(content_type=None)


async def stream(session, url, body):
    """(status, [event bodies]) of one streaming request, `[DONE]` excluded."""
    async with session.post(url, json=body | {"stream": True}) as r:
        if r.status != 200:
            return r.status, [await r.json(content_type=None)]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = []
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return r.status, events


def streamed_text(events, chat=False):
    if chat:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


async def metrics(session, base):
    async with session.get(f"{base}/metrics?format=json") as r:
        return await r.json()


async def wait_until(session, base, cond, what, timeout=60.0):
    """Poll /metrics until cond(snapshot) holds (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        snap = await metrics(session, base)
        if cond(snap):
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError(f"not {what} within {timeout} s: {snap}")


def test_responses_equal_dtrt_run(tiny, tiny_chat, server, monkeypatch, capsys):  # noqa: F811
    def dtrt_run(*args):
        pair = () if "--target" in args else ("--model", "tiny")
        code, out, err = run_cli(monkeypatch, capsys, "run", *pair, "--threads", "1", *args, "--json")
        assert code == 0, err
        return json.loads(out)

    stop = a_stop_word(dtrt_run("--max-new-tokens", "40", PROMPT)["text"])
    ref = dtrt_run("--max-new-tokens", "40", "--stop", stop, PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
    chat_ref = dtrt_run(
        "--target", str(tiny_chat.target), "--drafter", str(tiny.domino), "--max-new-tokens", "24", PROMPT
    )
    chat_body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0}
    chat_pipe = pipe_for(tiny_chat, spec("dominotree"))

    async def go():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
            url = f"{server.url}/v1/completions"
            status, plain = await post(s, url, body)
            assert status == 200 and plain["choices"][0]["text"] == ref["text"]
            assert plain["choices"][0]["finish_reason"] == "stop" and plain["object"] == "text_completion"
            assert plain["usage"]["completion_tokens"] == len(ref["tokens"]) and plain["dtrt"]["tau"] > 2
            status, events = await stream(s, url, body | {"stream_options": {"include_usage": True}})
            assert status == 200 and streamed_text(events) == ref["text"]
            assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1]["usage"] == plain["usage"]
            assert len(events) > 3  # the text really came in pieces

            with BackgroundServer(chat_pipe, ServeConfig("tiny-chat")) as chat_server:
                url = f"{chat_server.url}/v1/chat/completions"
                status, plain = await post(s, url, chat_body)
                assert status == 200 and plain["choices"][0]["message"] == {
                    "role": "assistant",
                    "content": chat_ref["text"],
                }
                assert plain["object"] == "chat.completion"
                status, events = await stream(s, url, chat_body)
                assert events[0]["choices"][0]["delta"]["role"] == "assistant"
                assert status == 200 and streamed_text(events, chat=True) == chat_ref["text"]
                assert events[-1]["object"] == "chat.completion.chunk"

    run(go())


def test_32_concurrent_clients(pipe, server):
    sizes = (8, 12, 16)
    expected = {
        (p, n): complete(pipe, encode(pipe.tokenizer, Request(p), False), n, SamplingConfig()).text
        for p in PROMPTS
        for n in sizes
    }
    assert len(set(expected.values())) == len(expected)  # every request has its own answer
    before = run(_metrics(server.url))

    async def client(s, i):
        got = []
        for j in range(3):
            p, n = PROMPTS[(3 * i + j) % len(PROMPTS)], sizes[(i + j) % len(sizes)]
            body = {"prompt": p, "max_tokens": n}
            if (i + j) % 2:
                status, out = await post(s, f"{server.url}/v1/completions", body)
                text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            else:
                status, events = await stream(s, f"{server.url}/v1/completions", body)
                text, finish = streamed_text(events), events[-1]["choices"][0]["finish_reason"]
            got.append((status, (p, n), text, finish))
        return got

    async def go():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as s:
            results = await asyncio.gather(*(client(s, i) for i in range(32)))
            async with s.get(f"{server.url}/health") as r:
                health = (r.status, await r.json())
            return results, health, await metrics(s, server.url)

    results, health, after = run(go())
    flat = [r for rs in results for r in rs]
    assert len(flat) == 96
    for status, key, text, finish in flat:
        assert status == 200 and text == expected[key] and finish == "length", key
    assert health == (200, {"status": "ok", "model": "tiny"})
    assert after["requests"]["ok"] - before["requests"]["ok"] == 96 and after["queue_length"] == 0
    assert after["in_flight"] == 0 and after["tau"] > 2


async def _metrics(base):
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        return await metrics(s, base)


def test_queue_limit_is_429(ar_pipe):
    with BackgroundServer(ar_pipe, ServeConfig("tiny", queue_limit=1)) as srv:
        url = f"{srv.url}/v1/completions"

        async def go():
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
                running = asyncio.create_task(stream(s, url, {"prompt": PROMPT, "max_tokens": LONG}))
                await wait_until(s, srv.url, lambda m: m["in_flight"] == 1, "generating")
                waiting = asyncio.create_task(post(s, url, {"prompt": PROMPT, "max_tokens": LONG}))
                await wait_until(s, srv.url, lambda m: m["queue_length"] == 1, "queued")
                status, body = await post(s, url, {"prompt": PROMPT, "max_tokens": 4})
                assert status == 429 and body["error"]["type"] == "rate_limit_exceeded"
                assert "queue is full" in body["error"]["message"]
                running.cancel(), waiting.cancel()  # the clients hang up: both are cancelled
                snap = await wait_until(
                    s, srv.url, lambda m: m["requests"]["cancelled"] == 2 and not m["in_flight"], "cancelled"
                )
                assert snap["requests"]["rejected"] == 1 and snap["queue_length"] == 0
                status, body = await post(s, url, {"prompt": PROMPT, "max_tokens": 4})
                assert status == 200 and len(body["choices"][0]["text"]) == 4

        run(go())


def test_timeout_is_504_and_cancels(ar_pipe):
    with BackgroundServer(ar_pipe, ServeConfig("tiny", request_timeout=1.0)) as srv:
        url = f"{srv.url}/v1/completions"

        async def go():
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
                status, body = await post(s, url, {"prompt": PROMPT, "max_tokens": LONG})
                assert status == 504 and body["error"]["type"] == "timeout" and "1 s" in body["error"]["message"]
                status, events = await stream(s, url, {"prompt": PROMPT, "max_tokens": LONG})
                assert status == 200 and events[-1]["error"]["type"] == "timeout" and streamed_text(events[:-1])
                snap = await wait_until(
                    s, srv.url, lambda m: m["requests"]["timeout"] == 2 and not m["in_flight"], "timed out"
                )
                assert snap["generated_tokens"] < 2 * LONG

        run(go())


def test_disconnect_cancels_the_generation(ar_pipe):
    with BackgroundServer(ar_pipe, ServeConfig("tiny")) as srv:

        async def go():
            async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
                r = await s.post(
                    f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "stream": True}
                )
                assert (await r.content.readline()).startswith(b"data: ")
                r.close()  # hang up mid-stream
                snap = await wait_until(
                    s, srv.url, lambda m: m["requests"]["cancelled"] == 1 and not m["in_flight"], "cancelled"
                )
                assert snap["generated_tokens"] < LONG and snap["requests"]["ok"] == 0

        run(go())


def test_graceful_shutdown(ar_pipe):
    srv = BackgroundServer(ar_pipe, ServeConfig("tiny")).__enter__()
    url = f"{srv.url}/v1/completions"

    async def go():
        async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
            running = asyncio.create_task(post(s, url, {"prompt": PROMPT, "max_tokens": 400}))
            await wait_until(s, srv.url, lambda m: m["in_flight"] == 1, "generating")
            waiting = asyncio.create_task(post(s, url, {"prompt": PROMPT, "max_tokens": 400}))
            await wait_until(s, srv.url, lambda m: m["queue_length"] == 1, "queued")
            stopping = asyncio.get_running_loop().run_in_executor(None, srv.stop)
            done, refused = await running, await waiting
            await stopping
            return done, refused

    (status, done), (status_refused, refused) = run(go())
    assert status == 200 and done["usage"]["completion_tokens"] == 400  # the one generating finished
    assert status_refused == 503 and "shutting down" in refused["error"]["message"]
    assert not srv._thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{srv.url}/health", timeout=5)


def test_sigterm_stops_dtrt_serve():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from dtrt.entry import main; main()",  # the `dtrt` command
            "serve",
            "--model",
            "tiny",
            "--port",
            "0",
            "--threads",
            "1",
            "--max-new-tokens",
            "8",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    try:
        lines = []
        for line in proc.stderr:  # ends if the process dies
            lines.append(line)
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
                break
        assert m, "".join(lines)
        req = urllib.request.Request(f"{m[1]}/v1/completions", json.dumps({"prompt": PROMPT}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["choices"][0]["text"]) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        rest = proc.stderr.read()
        assert "shutting down" in rest and "stopped" in rest and "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

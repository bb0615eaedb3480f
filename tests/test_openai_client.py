"""`dtrt serve` through the official `openai` client, as an application uses it, in one process and on 2 Ray Serve
replicas (tiny pair, loopback, an API key): chat and completions, streaming and not, stop strings, at T=0 exactly the
text `dtrt run` gives (complete() on the same pair), seeded sampling repeatable and choice i of n sampled with seed
+ i, logprobs equal to a plain forward of the target, usage equal to the token counts. On the replicas also: 32
concurrent clients each get their own complete answers from both replicas, and a replica killed under load loses
no request (each completes exactly, or ends with a clean error), after which the deployment serves on 2 replicas
again. The API key, the body and prompt limits, the exposure warning and the served model name are checked on the
single-process server (the same HTTP code fronts the replicas). Without Ray the replica cases skip."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from helpers import pipe_for, spec
from test_logprobs import reference_logprobs
from test_run_cli import PROMPT, tiny_chat  # noqa: F401 (fixture)

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from dtrt.frontend.requests import Request, encode  # noqa: E402
from dtrt.frontend.text import complete  # noqa: E402
from dtrt.models.checkpoint import load_target  # noqa: E402
from dtrt.runtime.sampling import SamplingConfig  # noqa: E402
from dtrt.serve import BackgroundServer, ServeConfig  # noqa: E402 (needs aiohttp)

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "sk-test-0123456789"
NAME = "tiny-chat"
# an upper bound on any one wait of the replica tests that only a hang reaches: above the server's own request
# deadline (--request-timeout 600 s, plus its backstop), so a slow machine makes a request slow, never a client timeout
SLOW_MACHINE_S = 900
PROMPTS = ["The cat sees ", "A quick fox ", "Every king walks ", "The moon is very ", "Some old man reads "]
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def local_pipe(tiny, tiny_chat):  # noqa: F811
    """The served pair in this process: what the answers must equal."""
    return pipe_for(tiny_chat, spec("dominotree"))


def served_pipe(tiny_chat):  # noqa: F811
    """A pipeline like local_pipe for a server in this process to own."""
    return pipe_for(tiny_chat, spec("dominotree"))


class DtrtServe:
    """`dtrt serve ARGS` in a subprocess, started and ended as the `dtrt` command does: its URL once it listens, its
    standard error kept (drained by a thread)."""

    def __init__(self, *args, timeout=180):
        cmd = [sys.executable, "-c", "from dtrt.entry import main; main()", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        self.lines, self.url = [], None
        started = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                if self.url is None and (m := re.search(r" on (http://127\.0\.0\.1:\d+)", line)):
                    self.url = m[1]
                    started.set()
            started.set()  # it ended

        threading.Thread(target=drain, daemon=True).start()
        if not started.wait(timeout) or self.url is None:
            self.stop()
            raise AssertionError(f"dtrt serve did not start: {self.log}")

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout=90) -> int:
        """SIGTERM, then its exit status (killed if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"dtrt serve did not stop within {timeout} s after SIGTERM: {self.log}") from None


@pytest.fixture(scope="module", params=["process", pytest.param("replicas", marks=pytest.mark.slow)])
def endpoint(request, tiny, tiny_chat, local_pipe):  # noqa: F811
    """(kind, base URL, DtrtServe or None) of `dtrt serve` in this process, or of `dtrt serve --replicas 2` (Ray
    Serve) in a subprocess, which must stop cleanly on SIGTERM afterwards."""
    if request.param == "process":  # its own pipeline: its worker fills the prefix cache while the tests run local_pipe
        with BackgroundServer(served_pipe(tiny_chat), ServeConfig(NAME, api_key=KEY)) as s:
            yield "process", s.url, None
        return
    pytest.importorskip("ray.serve", reason='the replica cases need Ray Serve: pip install "dtrt[ray]"')
    # the method local_pipe runs (a model without an entry would take lookup's chains at budget 4 on a CPU)
    pair = ("--target", str(tiny_chat.target), "--drafter", str(tiny.domino), "--budget", "16", "--no-lookup")
    # a shutdown grace no generation of these tests outlasts however slow the machine (only a hang reaches it)
    server = DtrtServe(
        *pair, "--threads", "1", "--replicas", "2", "--api-key", KEY, "--served-model-name", NAME,
        "--shutdown-grace", str(SLOW_MACHINE_S),
    )  # fmt: skip
    try:
        assert "2 replicas x 1 threads on Ray Serve" in server.log
        yield "replicas", server.url, server
    finally:
        code = server.stop()
    assert code == 0 and "dtrt serve: stopped" in server.log, server.log
    assert not unexpected_tracebacks(server.log), server.log


def unexpected_tracebacks(log: str) -> list[str]:
    """The exceptions of the tracebacks in a server's log, but for Ray Serve's router reporting a replica actor
    that died while the cluster shut down (Ray's own asyncio task, logged at SIGTERM under load)."""
    errors = []
    for block in log.split("Traceback (most recent call last):")[1:]:
        lines = block.split("\n")[1:]
        error = next((line for line in lines if line and not line[0].isspace()), "")
        if not error.startswith("ray.exceptions.ActorDiedError"):
            errors.append(error)
    return errors


def test_unexpected_tracebacks_spare_only_ray_replicas_dying_at_shutdown():
    ray_shutdown = 'Traceback (most recent call last):\n  File "r.py", line 1\nray.exceptions.ActorDiedError: died'
    ours = 'Traceback (most recent call last):\n  File "dtrt/serve.py", line 3, in g\nValueError: bad'
    assert unexpected_tracebacks(f"start\n{ray_shutdown}\nstopped") == []
    assert unexpected_tracebacks(f"{ray_shutdown}\n{ours}\n") == ["ValueError: bad"]


def client(url, key=KEY, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120, **kw)


def get(url, path, key=KEY):
    """(status, JSON) of a GET; an HTTP error status is returned, not raised."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference(pipe, prompt=None, messages=None, max_tokens=32, stop=(), temperature=0.0, seed=0, logprobs=None):
    """What `dtrt run` gives for the request: complete() on the same pair."""
    req = Request(prompt, messages)
    ids = encode(pipe.tokenizer, req, chat=False)
    return complete(pipe, ids, max_tokens, SamplingConfig(temperature, 1.0, seed), stop, logprobs=logprobs)


def test_completions_and_chat_equal_dtrt_run(endpoint, local_pipe):
    kind, url, _ = endpoint
    c = client(url)
    assert [m.id for m in c.models.list().data] == [NAME]
    plain = reference(local_pipe, PROMPT, max_tokens=40)
    stop = [w for w in plain.text.split(" ") if len(w) > 2][1]
    ref = reference(local_pipe, PROMPT, max_tokens=40, stop=(stop,))
    assert ref.stop_reason == "stop"

    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, len(ref.tokens))
    body = dict(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop], stream=True)
    chunks = list(c.completions.create(**body, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert all(ch.usage is None for ch in chunks[:-1])

    chat_ref = reference(local_pipe, messages=CHAT, max_tokens=24)
    r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == chat_ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if chat_ref.stop_reason == "length" else "stop")
    assert r.usage.completion_tokens == len(chat_ref.tokens) and r.usage.prompt_tokens == chat_ref.prompt_tokens
    chunks = list(
        c.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=24, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat_ref.text
    assert len(chunks) > 3 and all(ch.usage is None for ch in chunks)  # no usage chunk unless asked


def test_seeded_sampling_and_n(endpoint, local_pipe):
    kind, url, _ = endpoint
    c = client(url)
    ids = encode(local_pipe.tokenizer, Request(PROMPT), False)
    refs = {s: complete(local_pipe, ids, 24, SamplingConfig(0.9, 0.95, s)) for s in (7, 8)}
    assert refs[7].text != refs[8].text
    body = dict(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95)
    one = [c.completions.create(**body, seed=s).choices[0].text for s in (7, 7, 8)]
    assert one == [refs[7].text, refs[7].text, refs[8].text]  # repeatable for a seed, and dtrt run's sample
    r = c.completions.create(**body, seed=7, n=2)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [refs[7].text, refs[8].text]  # choice i samples with seed + i
    assert r.usage.completion_tokens == len(refs[7].tokens) + len(refs[8].tokens)
    assert r.usage.prompt_tokens == len(ids)

    chunks = list(c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0, n=2, stream=True))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i) for i in (0, 1)]
    greedy = reference(local_pipe, messages=CHAT, max_tokens=16).text
    assert texts == [greedy, greedy]  # at T=0 every choice is the one exact answer
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason) == [0, 1]


def test_logprobs_are_the_targets(endpoint, tiny_chat, local_pipe):  # noqa: F811
    kind, url, _ = endpoint
    c = client(url)
    target = load_target(tiny_chat.target)
    ids = encode(local_pipe.tokenizer, Request(PROMPT), False)
    ref = reference(local_pipe, PROMPT, max_tokens=20, temperature=0.8, seed=5, logprobs=3)
    expected = reference_logprobs(target, ids, ref.tokens)

    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0.8, seed=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text and len(lp.tokens) == len(ref.tokens) == r.usage.completion_tokens
    got = torch.tensor(lp.token_logprobs)
    want = expected.gather(-1, torch.tensor(ref.tokens)[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert "".join(lp.tokens).startswith(ref.text) and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chat_ids = encode(local_pipe.tokenizer, Request(messages=CHAT), False)
    chat_ref = reference(local_pipe, messages=CHAT, max_tokens=12, logprobs=2)
    chat_expected = reference_logprobs(target, chat_ids, chat_ref.tokens)
    body = dict(model=NAME, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    r = c.chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert len(content) == len(chat_ref.tokens) == r.usage.completion_tokens
    for entry, row, token in zip(content, chat_expected, chat_ref.tokens):
        assert abs(entry.logprob - row[token].item()) < 1e-4
        top_v, top_i = row.topk(2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # T=0: the most likely
        assert bytes(entry.bytes).decode() == entry.token
    chunks = list(c.chat.completions.create(**body, stream=True))
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


# the replicas under load


def replica_snapshot(url):
    status, snap = get(url, "/metrics?format=json")
    assert status == 200, snap
    return snap


def settled_snapshot(url, timeout=10.0):
    """/metrics once every replica's report counts the requests the server has answered (they report every half
    second)."""
    end = time.monotonic() + timeout
    while True:
        snap = replica_snapshot(url)
        if sum(r["requests"]["ok"] for r in snap["replicas"]) == snap["requests"]["ok"] or time.monotonic() > end:
            return snap
        time.sleep(0.1)


async def ask(ac, i, prompt, max_tokens, stream):
    """(i, text or None, error or None) of one completion through the async client."""
    try:
        if stream:
            chunks = await ac.completions.create(
                model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            text = "".join([ch.choices[0].text async for ch in chunks if ch.choices])
        else:
            r = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
            text = r.choices[0].text
        return i, text, None
    except openai.APIError as e:
        return i, None, e


def test_32_concurrent_clients_on_2_replicas(endpoint, local_pipe):
    kind, url, _ = endpoint
    if kind != "replicas":
        pytest.skip("tests/test_serve.py runs 32 clients against the single-process server")
    sizes = (8, 16)
    expected = {(p, n): reference(local_pipe, p, max_tokens=n).text for p in PROMPTS for n in sizes}
    before = {r["replica"]: r["requests"]["ok"] for r in settled_snapshot(url)["replicas"] if r["alive"]}
    jobs = [(PROMPTS[i % len(PROMPTS)], sizes[i % 2], i % 3 == 0) for i in range(64)]

    async def go():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        sem = asyncio.Semaphore(32)  # 32 clients at a time

        async def one(i, job):
            async with sem:
                return await ask(ac, i, *job)

        return await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))

    results = asyncio.run(go())
    for i, text, err in results:
        assert err is None and text == expected[jobs[i][:2]], (jobs[i], text, err)
    snap = settled_snapshot(url)
    served = {r["replica"]: r["requests"]["ok"] - before.get(r["replica"], 0) for r in snap["replicas"] if r["alive"]}
    assert len(served) == 2 and all(n > 0 for n in served.values()) and sum(served.values()) == 64, served
    assert snap["requests"]["ok"] >= 64 and snap["live_replicas"] == 2
    live = [r for r in snap["replicas"] if r["alive"]]  # the prefix caches' series: summed over the replicas
    assert snap["prefix_cache"]["lookups"] == sum(r["prefix_cache"]["lookups"] for r in live) >= 64


def test_disconnect_cancels_on_the_replica(endpoint):
    kind, url, _ = endpoint
    if kind != "replicas":
        pytest.skip("tests/test_serve.py checks disconnects on the single-process server")
    before = settled_snapshot(url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "stream": True}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body, headers), timeout=60)
    assert r.readline().startswith(b"data: ")
    r.close()  # hang up mid-stream: the replica stops generating at its next round
    end = time.monotonic() + 30
    while time.monotonic() < end:
        snap = replica_snapshot(url)
        on_replicas = sum(r["requests"]["cancelled"] for r in snap["replicas"])
        done = snap["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
        if done and on_replicas == sum(r["requests"]["cancelled"] for r in before["replicas"]) + 1:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the disconnect did not cancel the generation: {snap}")
    assert snap["in_flight"] == 0 and all(r["in_flight"] == 0 for r in snap["replicas"])
    assert snap["generated_tokens"] - before["generated_tokens"] < 3000


def test_a_replica_killed_under_load(endpoint, local_pipe):
    kind, url, _ = endpoint
    if kind != "replicas":
        pytest.skip("a single process has no replica to lose")
    expected = {p: reference(local_pipe, p, max_tokens=200).text for p in PROMPTS}
    snap = replica_snapshot(url)
    victim = next(r for r in snap["replicas"] if r["alive"])
    jobs = [(PROMPTS[i % len(PROMPTS)], 200, i % 2 == 0) for i in range(24)]

    async def go():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=SLOW_MACHINE_S)
        tasks = [asyncio.create_task(ask(ac, i, *job)) for i, job in enumerate(jobs)]
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while loop.time() < end:  # kill it while it generates, with requests waiting behind
            snap = await asyncio.to_thread(replica_snapshot, url)
            mine = [r for r in snap["replicas"] if r["replica"] == victim["replica"]]
            if mine and mine[0]["in_flight"] and mine[0]["queue_length"]:
                break
            await asyncio.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(go())
    ok = [i for i, text, err in results if err is None]
    failed = [(i, err) for i, text, err in results if err is not None]
    for i, text, err in results:
        if err is None:  # completed: exactly its own answer, nothing lost or mixed in
            assert text == expected[jobs[i][0]], (jobs[i], text)
    for i, err in failed:  # ended cleanly, saying why: only streams that had already sent text
        assert jobs[i][2] and "stopped before it finished" in str(err), (jobs[i], err)
    after = replica_snapshot(url)
    print(f"\nkilled replica pid {victim['pid']}: {len(ok)} ok ({after['retried']} sent again), {len(failed)} failed")
    assert after["retried"] >= 1 and len(ok) + len(failed) == len(jobs)

    end = time.monotonic() + 120  # Ray Serve starts a replacement; /health counts it once it serves
    while time.monotonic() < end:
        status, health = get(url, "/health", key=None)
        live = [r for r in replica_snapshot(url)["replicas"] if r["alive"]]
        if status == 200 and health["replicas"] == 2 and victim["pid"] not in {r["pid"] for r in live}:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"not 2 live replicas again within 120 s: {health}")
    before = {r["replica"]: r["requests"]["ok"] for r in settled_snapshot(url)["replicas"] if r["alive"]}

    async def again():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=SLOW_MACHINE_S)
        return await asyncio.gather(*(ask(ac, i, PROMPTS[i % len(PROMPTS)], 200, i % 2 == 0) for i in range(8)))

    for i, text, err in asyncio.run(again()):
        assert err is None and text == expected[PROMPTS[i % len(PROMPTS)]], (i, text, err)
    snap = settled_snapshot(url)
    served = {r["replica"]: r["requests"]["ok"] - before.get(r["replica"], 0) for r in snap["replicas"] if r["alive"]}
    assert len(served) == 2 and all(served.values()), served  # the replacement serves too


def test_sigterm_with_requests_on_the_replicas(endpoint, local_pipe):
    """SIGTERM as in one process: the generating requests finish (exactly), the waiting ones are answered 503, and
    `dtrt serve` exits 0 (the fixture checks its log)."""
    kind, url, server = endpoint
    if kind != "replicas":
        pytest.skip("tests/test_serve.py checks SIGTERM on the single-process server")
    expected = reference(local_pipe, PROMPT, max_tokens=600).text
    results = []

    def ask_one():
        body = json.dumps({"prompt": PROMPT, "max_tokens": 600}).encode()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", body, headers)) as r:
                results.append((r.status, json.loads(r.read())))
        except urllib.error.HTTPError as e:
            results.append((e.code, json.loads(e.read())))

    threads = [threading.Thread(target=ask_one) for _ in range(8)]
    for t in threads:
        t.start()
    end = time.monotonic() + SLOW_MACHINE_S
    while time.monotonic() < end:  # each replica generating one, with more waiting behind it
        live = [r for r in replica_snapshot(url)["replicas"] if r["alive"]]
        if sum(r["in_flight"] for r in live) == 2 and sum(r["queue_length"] for r in live) >= 2:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the replicas never held two generations with two waiting: {live}")
    assert server.stop(timeout=SLOW_MACHINE_S) == 0  # the generating ones finish within the grace
    for t in threads:
        t.join(SLOW_MACHINE_S)
    done = [b for status, b in results if status == 200]
    refused = [b for status, b in results if status == 503]
    assert len(done) + len(refused) == 8 and len(done) >= 2 and refused, results
    assert all(b["choices"][0]["text"] == expected for b in done)
    assert all(b["error"]["message"] == "the server is shutting down" for b in refused)


# the HTTP front: the API key, the limits, the warning, the name


def test_api_key_and_limits(local_pipe):
    cfg = ServeConfig(NAME, api_key=KEY, max_request_bytes=4096, max_prompt_tokens=16)
    with BackgroundServer(local_pipe, cfg) as s:
        with pytest.raises(openai.AuthenticationError) as e:
            client(s.url, key="sk-wrong").completions.create(model=NAME, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 401 and "not this server's" in e.value.message
        status, body = get(s.url, "/v1/models", key=None)
        assert status == 401 and "Authorization: Bearer <key>" in body["error"]["message"]
        assert body["error"]["code"] == "invalid_api_key"
        assert get(s.url, "/metrics?format=json", key="sk-wrong")[0] == 401
        assert get(s.url, "/health", key=None) == (200, {"status": "ok", "model": NAME})  # open without a key
        c = client(s.url)
        assert c.completions.create(model=NAME, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=NAME, prompt="x" * 5000, max_tokens=4)
        assert e.value.status_code == 413 and "--max-request-bytes" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=NAME, prompt="The cat sees the dog " * 4, max_tokens=4)
        assert "--max-prompt-tokens 16" in e.value.message and e.value.body["param"] == "prompt"
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4)
        assert f"this server serves '{NAME}'" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=NAME, messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}]
            )
        assert e.value.body["param"] == "tools"


def test_exposure_warning_and_served_name(tiny, tiny_export, monkeypatch):
    from dtrt.launch import open_sources, resolve_spec, served_model_name
    from dtrt.serve.server import exposure_warning

    open_cfg, keyed = ServeConfig("x"), ServeConfig("x", api_key=KEY)
    for host in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(host, open_cfg) is None
    assert "--host 0.0.0.0 listens beyond this machine and no --api-key is set" in exposure_warning("0.0.0.0", open_cfg)
    assert exposure_warning("0.0.0.0", keyed) is None

    default = resolve_spec()  # the embedded default is served under its registry name, as `dtrt run --model` takes
    assert served_model_name(default, None) == default.model == "smollm2-135m"
    named = resolve_spec(model="tiny")
    assert served_model_name(named, open_sources(named, pair=tiny)) == "tiny"
    assert served_model_name(named, open_sources(named, pair=tiny), "mine") == "mine"
    target = resolve_spec(target=str(tiny.target), drafter=str(tiny.domino))
    assert served_model_name(target, open_sources(target)) == tiny.target.name
    exported = resolve_spec(export=str(tiny_export.path))
    assert served_model_name(exported, open_sources(exported)) == "tiny"  # the model its manifest names


def test_replica_plan():
    """What Ray Serve is asked for: a fixed count, or autoscaling between --replicas and --max-replicas; each
    replica's queue bounded by --queue-limit; the CPUs and GPUs it reserves, refused in one line when the cluster
    cannot hold the replicas."""
    from dtrt.errors import DtrtError
    from dtrt.serve.replicas import ReplicaPlan, ReplicaWorkers

    class Cluster:  # what ReplicaWorkers reads of ray: its nodes' resources
        def __init__(self, *nodes):
            self._nodes = [{"Alive": True, "Resources": n} for n in nodes]

        def nodes(self):
            return self._nodes

    def resources(plan, *nodes, device="cpu"):
        return ReplicaWorkers(spec("dominotree", device=device), ServeConfig(NAME), plan)._resources(Cluster(*nodes))

    assert resources(ReplicaPlan(2), {"CPU": 16}) == (8, 0.0)  # cores // replicas
    assert resources(ReplicaPlan(2, 4), {"CPU": 16}) == (4, 0.0)  # room for the most replicas
    assert resources(ReplicaPlan(6), {"CPU": 8}, {"CPU": 8}, {"CPU": 8}) == (4, 0.0)  # the cluster's, per node
    with pytest.raises(DtrtError, match=r"--replicas 4 x 2 threads need 8 CPUs \(2 on one node\), and the Ray "):
        resources(ReplicaPlan(4, threads=2), {"CPU": 2})
    with pytest.raises(DtrtError, match="lower --replicas or --threads"):
        resources(ReplicaPlan(1, threads=4), {"CPU": 2}, {"CPU": 2})  # 4 CPUs, but not on one node
    assert resources(ReplicaPlan(2), {"CPU": 4, "GPU": 1}, device="cuda") == (2, 0.5)  # two replicas share the GPU
    assert resources(ReplicaPlan(2), {"CPU": 4, "GPU": 4}, device="cuda:1") == (2, 1.0)
    with pytest.raises(DtrtError, match="--device cuda: the Ray cluster has no GPU"):
        resources(ReplicaPlan(2), {"CPU": 4}, device="cuda")

    from dtrt.serve.schema import parse_openai
    from dtrt.serve.worker import ServeError

    workers = ReplicaWorkers(spec("dominotree"), ServeConfig(NAME, queue_limit=1), ReplicaPlan(2))
    workers.outstanding = 4  # every replica has one generating and one waiting
    with pytest.raises(ServeError) as e:
        asyncio.run(anext(workers.stream(parse_openai({"prompt": "x"}, Request(), False), False)))
    assert e.value.status == 429 and "every replica's queue is full (2 replicas, 1 requests waiting" in e.value.message
    assert workers.metrics.snapshot(0, 0)["requests"]["rejected"] == 1 and workers.outstanding == 4

    cfg = ServeConfig(NAME, queue_limit=8, shutdown_grace=10)
    fixed = ReplicaPlan(2).deployment_options(cfg, threads=3, gpus=0.0)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 9 and fixed["ray_actor_options"] == {"num_cpus": 3, "num_gpus": 0.0}
    scaled = ReplicaPlan(1, 4).deployment_options(cfg, threads=1, gpus=0.5)
    auto = scaled["autoscaling_config"]
    assert "num_replicas" not in scaled and (auto["min_replicas"], auto["max_replicas"]) == (1, 4)
    assert auto["initial_replicas"] == 1 and auto["target_ongoing_requests"] == 2
    assert ReplicaPlan(2, 4).most == 4 and ReplicaPlan(2).most == 2

"""The prefix cache (dtrt.runtime.prefix_cache): multi-turn conversations give the same tokens with and without it,
on torch and ONNX Runtime, with drafts and lookup nodes accepted; restored state is bit for bit what a whole prefill
computes; eviction under a small limit; T>0 with a seed; `dtrt serve`'s usage and /metrics; `dtrt run --input`."""

import asyncio
import json

import pytest
import torch
from helpers import PROMPTS, pipe_for, run_cli, spec

from dtrt.errors import DtrtError
from dtrt.runtime.prefix_cache import PrefixCache, boundaries, kept
from dtrt.runtime.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40
TURN = " and so the story goes on: "
PREAMBLE = " ".join(PROMPTS)  # about 80 tokens: a first prompt holds a whole prefill chunk (CHUNK, 64)


def pipes(tiny, tiny_export=None, **fields):
    """(cached, uncached) DominoTree + lookup pipelines on torch, or on ONNX Runtime over `tiny_export`."""
    run = spec("dominotree", lookup=True, **fields)
    where = {} if tiny_export is None else dict(backend="onnxruntime", export=tiny_export.path, threads=1)
    pair = tiny if tiny_export is None else None
    return pipe_for(pair, run, **where), pipe_for(pair, spec("dominotree", lookup=True, prefix_cache_mb=0), **where)


GREEDY = SamplingConfig()


def converse(pipe, first: str, turns: int, sampling=GREEDY, remember=True) -> list:
    """`turns` turns of one conversation: each prompt is the last one, its answer and TURN."""
    tok = pipe.tokenizer
    ids, out = tok.encode(PREAMBLE + first, add_special_tokens=False), []
    for _ in range(turns):
        g = pipe.generate(ids, NEW, sampling)
        out.append(g)
        if remember:
            pipe.remember(ids + g.tokens)
        ids = ids + g.tokens + tok.encode(TURN, add_special_tokens=False)
    return out


def check_conversations(cached, uncached, prompts=PROMPTS[:3], turns=3):
    hits = accepted = rounds = from_lookup = 0
    for first in prompts:
        a, b = converse(cached, first, turns), converse(uncached, first, turns)
        assert [g.tokens for g in a] == [g.tokens for g in b]
        hits += sum(g.cached_tokens for g in a[1:])
        assert all(g.cached_tokens > 0 for g in a[1:])
        assert all(g.cached_tokens == 0 for g in b)
        accepted += sum(r.accepted for g in a for r in g.rounds)
        rounds += sum(len(g.rounds) for g in a)
        from_lookup += sum(r.lookup for g in a for r in g.rounds)
    assert hits > 0 and accepted / rounds > 1 and from_lookup > 0  # drafts and lookup nodes accepted


def state(backend) -> tuple:
    return backend.snapshot(backend.past)


def check_bits(cached, uncached):
    """A second turn restored from the cache leaves the state, K/V and drafter context, a whole prefill leaves."""
    tok = cached.tokenizer
    first = tok.encode(PREAMBLE + PROMPTS[0], add_special_tokens=False)
    g = cached.generate(first, NEW, SamplingConfig())
    cached.remember(first + g.tokens)
    ids = first + g.tokens + tok.encode(TURN, add_special_tokens=False)
    a = cached.generate(ids, 1, SamplingConfig())
    b = uncached.generate(ids, 1, SamplingConfig())
    assert a.cached_tokens > len(first) and a.tokens == b.tokens
    for x, y in zip(state(cached.backend), state(uncached.backend), strict=True):
        assert torch.equal(x, y)


def test_conversations_on_torch(tiny):
    cached, uncached = pipes(tiny)
    check_conversations(cached, uncached)
    check_bits(*pipes(tiny))


def test_conversations_under_static_shapes(tiny):
    """--static-shapes restores a prefix into its fixed buffer, the device's committed length with it: the same
    conversations, drafts and lookup nodes accepted, and a restored turn's state bit for bit a whole prefill's."""

    def static(cache_mb=None):
        p = pipe_for(tiny, spec("dominotree", lookup=True, static_shapes=True, prefix_cache_mb=cache_mb))
        p.backend.max_context = 512  # the tiny target's 4,096 makes every static call longer on the CPU
        return p

    check_conversations(static(), static(0))
    cached, uncached = static(), static(0)
    check_bits(cached, uncached)
    backend = cached.backend
    saved = backend.snapshot(backend.past)
    backend.reset(backend.capacity)
    backend.restore(saved, 30)
    assert backend.past == backend.draft_cache.length == int(backend.cache.length) == 30


def test_conversations_on_onnxruntime(tiny, tiny_export):
    cached, uncached = pipes(tiny, tiny_export)
    check_conversations(cached, uncached)
    check_bits(*pipes(tiny, tiny_export))


def test_shared_system_prompt_without_remember(tiny):
    """Requests behind the same long prefix restore it from the first request's prefill alone."""
    cached, uncached = pipes(tiny)
    system = " ".join(PROMPTS) * 4
    for p in PROMPTS[:3]:
        ids = cached.tokenizer.encode(system + p, add_special_tokens=False)
        a, b = cached.generate(ids, NEW, SamplingConfig()), uncached.generate(ids, NEW, SamplingConfig())
        assert a.tokens == b.tokens
    assert a.cached_tokens == len(cached.tokenizer.encode(system, add_special_tokens=False)) // 64 * 64  # whole chunks


def test_evicted_mid_conversation(tiny):
    """Three conversations interleaved under a 1 MiB limit (about 540 positions of the tiny pair): snapshots evict
    each other, the tokens stay the same, and evictions are counted."""
    cached, uncached = pipes(tiny)
    cached.prefix_cache = PrefixCache(limit_mb=1)
    tok = cached.tokenizer
    convs = {p: tok.encode(PREAMBLE + p, add_special_tokens=False) for p in PROMPTS[:3]}
    for _ in range(3):
        for p, ids in convs.items():
            a, b = cached.generate(ids, NEW, SamplingConfig()), uncached.generate(ids, NEW, SamplingConfig())
            assert a.tokens == b.tokens
            cached.remember(ids + a.tokens)
            convs[p] = ids + a.tokens + tok.encode(TURN, add_special_tokens=False)
    stats = cached.prefix_cache.stats
    assert stats.evictions > 0 and stats.hits > 0 and cached.prefix_cache.used <= 2**20


def test_same_seed_at_t1(tiny):
    cached, uncached = pipes(tiny)
    for seed in (0, 1):
        cfg = SamplingConfig(1.0, 0.9, seed)
        a, b = converse(cached, PROMPTS[1], 3, cfg), converse(uncached, PROMPTS[1], 3, cfg)
        assert [g.tokens for g in a] == [g.tokens for g in b]
        assert all(g.cached_tokens > 0 for g in a[1:])


def test_hybrid_target_is_refused_in_one_line(tiny):
    from dtrt.zoo.registry import tiny_hybrid_pair

    pair = tiny_hybrid_pair()
    assert pipe_for(pair, spec("ar")).prefix_cache is None  # off by default, silently
    with pytest.raises(DtrtError, match=r"--prefix-cache-mb 64: a hybrid \(Gated-DeltaNet\) target"):
        pipe_for(pair, spec("ar", prefix_cache_mb=64))


def test_bad_flags(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--prefix-cache-mb", "-1", "x")
    assert code == 2 and "--prefix-cache-mb -1: must be >= 0" in err
    args = ("run", "--model", "tiny", "--prefix-cache-mb", "8", "--no-prefix-cache", "x")
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "--prefix-cache-mb 8 and --no-prefix-cache exclude each other" in err


def test_run_input_multi_turn(tiny, tmp_path, monkeypatch, capsys):
    """A JSONL file whose second line continues the first's conversation restores it; the tokens are those of
    --no-prefix-cache."""
    first = PREAMBLE + PROMPTS[0]
    line = {"prompt": first, "max_tokens": NEW}
    code, out, _ = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--method", "dominotree", "--json", first)
    text = json.loads(out)["text"]
    requests = tmp_path / "requests.jsonl"
    lines = [line, {"prompt": first + text + TURN, "max_tokens": NEW}]
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    results = {}
    for flags in ((), ("--no-prefix-cache",)):
        args = ("run", "--model", "tiny", "--method", "dominotree", "--input", str(requests), *flags)
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
        results[flags] = [json.loads(x) for x in out.splitlines()]
    on, off = results[()], results[("--no-prefix-cache",)]
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
    assert on[1]["cached_tokens"] >= 128 and off[1]["cached_tokens"] == 0  # the first line's prompt and answer


def test_serve_reports_the_hit(tiny):
    aiohttp = pytest.importorskip("aiohttp")
    from dtrt.serve import BackgroundServer, ServeConfig

    cached, uncached = pipes(tiny)

    async def ask(url, prompt):
        async with aiohttp.ClientSession() as s:
            body = {"prompt": prompt, "max_tokens": NEW}
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
                answer = await r.json()
            async with s.get(f"{url}/metrics") as r:
                return answer, await r.text()

    with BackgroundServer(cached, ServeConfig("tiny")) as srv:
        first, _ = asyncio.run(ask(srv.url, PREAMBLE + PROMPTS[0]))
        second_prompt = PREAMBLE + PROMPTS[0] + first["choices"][0]["text"] + TURN
        second, metrics = asyncio.run(ask(srv.url, second_prompt))
    ids = uncached.tokenizer.encode(second_prompt, add_special_tokens=False)
    want = uncached.tokenizer.decode(uncached.generate(ids, NEW, SamplingConfig()).tokens)
    assert second["choices"][0]["text"] == want
    cached_tokens = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_tokens > 0 and second["dtrt"]["cached_tokens"] == cached_tokens
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "dtrt_prefix_cache_hits_total 1" in metrics
    assert f"dtrt_prefix_cache_hit_tokens_total {cached_tokens}" in metrics


def chat(pipe, first: str, turns: int, sampling=GREEDY) -> tuple[list, list]:
    """`turns` turns of one conversation in which every answer ends with the stop id, as a chat template ends each
    message (`remember` is given what `dtrt serve` gives it: the answer as generated, most cut by the token limit):
    (generations, prompts)."""
    tok, stop = pipe.tokenizer, pipe.eos[0]
    ids, out, prompts = tok.encode(PREAMBLE + first, add_special_tokens=False) + [stop], [], []
    for _ in range(turns):
        prompts.append(ids)
        g = pipe.generate(ids, NEW, sampling)
        out.append(g)
        pipe.remember(ids + g.tokens)
        answer = g.tokens if g.tokens[-1] == stop else g.tokens + [stop]
        ids = ids + answer + tok.encode(TURN, add_special_tokens=False)
    return out, prompts


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_turns_restore_up_to_the_last_answer(tiny, tiny_export, backend):
    """Calls end after every stop id: a turn restores its whole history up to the last answer's end, not the whole
    chunks before it, and the tokens are an uncached pipeline's; on torch the state the next turn restores (what
    `remember` prefilled, up to the last answer's end) is bit for bit a whole prefill's of that next prompt."""
    cached, uncached = pipes(tiny, tiny_export if backend == "onnxruntime" else None)
    for first in PROMPTS[:2]:
        a, prompts = chat(cached, first, 3)
        b, _ = chat(uncached, first, 3)
        assert [g.tokens for g in a] == [g.tokens for g in b]
        for g, prev, ids in zip(a[1:], prompts, prompts[1:]):
            answered = len(ids) - len(cached.tokenizer.encode(TURN, add_special_tokens=False))
            assert g.cached_tokens == answered and answered % 64 != 0 and answered > len(prev)
    assert sum(r.lookup for g in a for r in g.rounds) > 0 and sum(r.accepted for g in a for r in g.rounds) > 0
    if backend == "torch":  # what the next turn restores from the last answer's `remember`, and a whole prefill of it
        stop = cached.eos[0]
        answered = prompts[-1] + (a[-1].tokens if a[-1].tokens[-1] == stop else a[-1].tokens + [stop])
        n = kept(boundaries(answered, cached.eos))
        assert n == len(answered)  # up to the answer's end, past the last prompt's own last (shorter) call
        uncached.generate(answered + cached.tokenizer.encode(TURN, add_special_tokens=False), 1, GREEDY)
        for x, y in zip(cached.backend.snapshot(n), uncached.backend.snapshot(n), strict=True):
            assert torch.equal(x, y)


def test_lookup_index_is_restored(tiny):
    """The second turn's lookup index is a fork of the cached one (not rebuilt), and proposes what a fresh build
    proposes."""
    from dtrt.tree.lookup import LookupIndex

    cached, _ = pipes(tiny)
    _, prompts = chat(cached, PROMPTS[0], 2)
    index = cached.method.lookup_index()
    assert index.base, "the second turn built its index afresh"
    fresh = LookupIndex(index.tokens)
    assert index.tokens == fresh.tokens and index.match() == fresh.match()
    assert index.propose(max_len=4, n_alternatives=3) == fresh.propose(max_len=4, n_alternatives=3)


def test_prompt_snapshot_is_kept_after_the_last_round(tiny):
    """The prompt's snapshot is copied when the generation ends (run to the end, or closed by its consumer), not
    before its first round; a generation closed after another one began keeps nothing."""
    cached, _ = pipes(tiny)
    cache = cached.prefix_cache
    ids = cached.tokenizer.encode(PREAMBLE + PROMPTS[0], add_special_tokens=False)
    steps = cached.stream(ids, NEW, GREEDY)
    next(steps)
    next(steps)
    assert not cache.entries  # two rounds out, nothing copied yet
    steps.close()
    assert [len(e.tokens) for e in cache.entries.values()] == [64]
    late = cached.stream(ids + ids, NEW, GREEDY)
    next(late)
    cached.generate(ids[:70], 4, GREEDY)
    late.close()  # another generation owns the backend's state now
    assert all(len(e.tokens) <= 64 for e in cache.entries.values())


def test_remember_stops_for_a_waiting_request(tiny):
    """remember() stopped early keeps what it prefilled, up to a boundary; the next turn restores that much and
    gives the uncached tokens."""
    cached, uncached = pipes(tiny)
    tok = cached.tokenizer
    ids = tok.encode((PREAMBLE + " ") * 3 + PROMPTS[2], add_special_tokens=False)  # 266 tokens: 256 kept
    g = cached.generate(ids, 3 * NEW, GREEDY)
    assert len(ids + g.tokens) >= 384  # two more calls for remember() to prefill
    calls = []
    cached.remember(ids + g.tokens, stop_early=lambda: calls.append(1) or True)  # asked between calls
    cache = cached.prefix_cache
    assert cache.stats.interrupted == 1 and len(calls) == 1
    held = max(len(e.tokens) for e in cache.entries.values())
    assert held == 320  # the prompt's 256 kept positions, and the one call after them
    nxt = ids + g.tokens + tok.encode(TURN, add_special_tokens=False)
    a, b = cached.generate(nxt, NEW, GREEDY), uncached.generate(nxt, NEW, GREEDY)
    assert a.tokens == b.tokens and a.cached_tokens == held


def test_a_request_coming_in_stops_remember(tiny):
    """`dtrt serve`'s scheduler: a request that comes in while the last answer is being remembered stops that
    prefill at its next call, and is answered as without the cache."""
    from dtrt.serve.metrics import Metrics
    from dtrt.serve.scheduler import Job, Scheduler

    cached, uncached = pipes(tiny)
    tok, loop = cached.tokenizer, asyncio.new_event_loop()
    first = tok.encode((PREAMBLE + " ") * 3 + PROMPTS[2], add_special_tokens=False)
    then = tok.encode(PREAMBLE + PROMPTS[1], add_special_tokens=False)
    a, b = (Job(ids, 3 * NEW, GREEDY, (), False, loop) for ids in (first, then))
    sched = Scheduler(cached, 4, Metrics(), log=print)
    remember, stopped = cached.remember, []

    def arrives(tokens, stop_early=None):  # b comes in just as a's answer starts being remembered
        if tokens[: len(first)] == first:
            sched.submit(b)
            remember(tokens, stop_early)
            stopped.append(cached.prefix_cache.stats.interrupted)
        else:
            remember(tokens, stop_early)

    cached.remember = arrives

    async def answer(job):
        while (event := await job.events.get())[0] not in ("done", "error"):
            pass
        return event

    async def both():
        return await asyncio.gather(answer(a), answer(b))

    sched.submit(a)
    sched.start()
    try:
        (ka, ca), (kb, cb) = loop.run_until_complete(both())
    finally:
        sched.close()
        sched.join(10)
        loop.close()
    assert ka == kb == "done" and stopped == [1]
    assert cb.tokens == uncached.generate(then, 3 * NEW, GREEDY).tokens


def test_summed_over_replicas():
    from dtrt.serve.metrics import PREFIX_CACHE, prometheus, summed_caches

    one = {key: i + 1 for i, (key, *_) in enumerate(PREFIX_CACHE)}
    snaps = [{"prefix_cache": one}, {"prefix_cache": {k: 2 * v for k, v in one.items()}}, {}]
    total = summed_caches(snaps)
    assert total == {k: 3 * v for k, v in one.items()} and summed_caches([{}]) is None
    assert f"dtrt_prefix_cache_hits_total {3 * one['hits']}" in prometheus(
        {"requests": {}, "queue_length": 0, "in_flight": 0, "tau": 0, "tokens_per_s": 0, "generated_tokens": 0}
        | {"ttft_s": {"p50": 0, "p99": 0, "sum": 0, "count": 0}, "prefix_cache": total}
    )

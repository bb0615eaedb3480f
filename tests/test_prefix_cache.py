"""The prefix cache (dtrt.runtime.prefix_cache): multi-turn conversations give the same tokens with and without it,
on torch and ONNX Runtime, with drafts and lookup nodes accepted; restored state is bit for bit what a whole prefill
computes; eviction under a small limit; T>0 with a seed; `dtrt serve`'s usage and /metrics; `dtrt run --input`."""

import asyncio
import json

import pytest
import torch
from helpers import PROMPTS, pipe_for, run_cli, spec

from dtrt.errors import DtrtError
from dtrt.runtime.prefix_cache import PrefixCache
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

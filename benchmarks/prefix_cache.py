"""Time to first token with and without the prefix cache (dtrt.runtime.prefix_cache), on the embedded default where
its first-use export is in the cache, else on the tiny pair:

- the second turns of MT-Bench questions: turn 1 generated and kept (`Pipeline.remember`, what `dtrt serve` does
  while idle), then turn 2 (the chat template over turn 1, its answer and the second question) without the cache
  and with it;
- requests behind a long system prompt (an essay's first tokens, or MT-Bench questions where the essays are not
  installed): one request fills the cache, then each other question without the cache and with it.

Each pair's tokens must be equal. TTFT is the generation's prefill step (restore + prefill of the rest + first
choice + drafter context), the same clock `dtrt run --json` reports as prefill_s.

    python benchmarks/prefix_cache.py --questions 20 --system-tokens 2048 --threads 1
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from dtrt.bench.datasets import documents, load
from dtrt.frontend.requests import has_chat_template, render_chat
from dtrt.launch import resolve_spec
from dtrt.launch.start import pipeline
from dtrt.runtime.sampling import SamplingConfig


def open_pipe(threads: int, model: str | None):
    """The embedded default where its first-use export exists, else the tiny pair (or `model`)."""
    if model is None:
        exports = Path(os.environ.get("DTRT_CACHE", Path.home() / ".cache" / "dtrt")) / "exports"
        model = None if any(exports.glob("smollm2-135m-*")) else "tiny"
    return pipeline(resolve_spec(model=model, threads=threads)), model or "smollm2-135m (the embedded default)"


def encode(pipe, messages) -> list[int]:
    """The chat's prompt ids (the tiny pair has no chat template: its messages one after another)."""
    tok = pipe.tokenizer
    text = render_chat(tok, messages) if has_chat_template(tok) else "\n".join(m["content"] for m in messages)
    return tok.encode(text, add_special_tokens=False)


def pair(pipe, ids: list[int], new: int) -> tuple[float, float, int]:
    """(uncached TTFT, cached TTFT, cached tokens) of one prompt; the two generations' tokens must be equal."""
    cache, pipe.prefix_cache = pipe.prefix_cache, None
    off = pipe.generate(ids, new, SamplingConfig())
    pipe.prefix_cache = cache
    on = pipe.generate(ids, new, SamplingConfig())
    if on.tokens != off.tokens:
        raise SystemExit(f"tokens differ with the cache: {on.tokens} != {off.tokens}")
    return off.prefill_s, on.prefill_s, on.cached_tokens


def report(name: str, rows: list[tuple[float, float, int]], lengths: list[int]):
    off, on, hit = (list(x) for x in zip(*rows))
    ratio = [b / a for a, b in zip(off, on)]
    print(
        f"{name}: {len(rows)} prompts, {statistics.mean(lengths):.0f} prompt tokens on average, "
        f"{statistics.mean(hit):.0f} restored; TTFT without the cache {statistics.median(off) * 1e3:.0f} ms "
        f"(median), with it {statistics.median(on) * 1e3:.0f} ms; ratio {statistics.median(ratio):.3f} median "
        f"[{min(ratio):.3f}, {max(ratio):.3f}], total {sum(on) / sum(off):.3f}; tokens equal"
    )


def second_turns(pipe, n: int, answer: int, new: int):
    rows, lengths = [], []
    for q in [p for p in load("mt-bench", None) if len(p.turns) > 1][:n]:
        first = [{"role": "user", "content": q.turns[0]}]
        ids = encode(pipe, first)
        g = pipe.generate(ids, answer, SamplingConfig())
        pipe.remember(ids + g.tokens)  # what dtrt serve does after answering, while idle
        text = pipe.tokenizer.decode(g.tokens, skip_special_tokens=True)
        second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": q.turns[1]}]
        ids = encode(pipe, second)
        rows.append(pair(pipe, ids, new))
        lengths.append(len(ids))
    report("MT-Bench second turns", rows, lengths)


def system_prompt(pipe, tokens: int) -> str:
    try:
        text = documents("essays")[0].text
    except Exception:  # the essays' package is not installed: MT-Bench's questions, one after another
        text = "\n\n".join(t for p in load("mt-bench", None) for t in p.turns)
    ids = pipe.tokenizer.encode(text[: tokens * 8], add_special_tokens=False)[:tokens]
    return "Answer questions about this text.\n\n" + pipe.tokenizer.decode(ids)


def behind_system_prompt(pipe, tokens: int, n: int, new: int):
    system = system_prompt(pipe, tokens)
    questions = [p.turns[0] for p in load("mt-bench", None)][: n + 1]
    chat = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    pipe.generate(encode(pipe, chat(questions[0])), 1, SamplingConfig())  # fills the cache
    rows, lengths = [], []
    for q in questions[1:]:
        ids = encode(pipe, chat(q))
        rows.append(pair(pipe, ids, new))
        lengths.append(len(ids))
    report(f"behind a {tokens}-token system prompt", rows, lengths)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=20, help="MT-Bench questions whose second turn is timed")
    ap.add_argument("--answer-tokens", type=int, default=128, help="turn 1's answer, at most")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per timed request (compared)")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--system-requests", type=int, default=3, help="requests timed behind the system prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a registry name (default: the embedded default if exported)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pipe, name = open_pipe(args.threads, args.model)
    print(f"model {name}, {pipe.spec.label}, {pipe.backend.name}, {args.threads} thread(s)")
    second_turns(pipe, args.questions, args.answer_tokens, args.new_tokens)
    behind_system_prompt(pipe, args.system_tokens, args.system_requests, args.new_tokens)
    print(f"cache: {pipe.prefix_cache.snapshot()}; {time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()

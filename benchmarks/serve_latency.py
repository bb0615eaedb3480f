"""Latency of `dtrt serve` as clients see it: time to first token (TTFT) and per-token latency (the time from the
first to the last text chunk over the tokens after the first), p50 / p99, at several client concurrencies, for each
method and each replica count against the same server settings (plain AR included). Requests stream over loopback;
each pipeline is batch 1, so at concurrency c a request also waits for the ones ahead of it on its replica.

    python benchmarks/serve_latency.py                                   # tiny pair, dominotree vs ar, c = 1, 2, 4
    python benchmarks/serve_latency.py --model smollm2-135m --methods ar --max-tokens 32
    python benchmarks/serve_latency.py --methods dominotree --replicas process,2 --concurrency 1,4,8 --model tiny
    python benchmarks/serve_latency.py --url http://127.0.0.1:8000      # a server already running (its method)

Each (method, replicas) gets its own `dtrt serve` subprocess (so the clients do not share the server's
interpreter), started on a free port with --threads (per replica), warmed up with one request per replica, and
stopped with SIGTERM. `--replicas process` is the single-process server; a number N is `dtrt serve --replicas N`
(Ray Serve, pip install "dtrt[ray]").
"""

import argparse
import asyncio
import json
import math
import re
import subprocess
import sys
import threading
import time

import aiohttp

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


def percentile(values, q):
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


async def one_request(session, url, prompt, max_tokens):
    """(ttft_s, per_token_s, tokens) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    return first - t0, (last - first) / (tokens - 1) if tokens > 1 else float("nan"), tokens


async def load(url, concurrency, requests, max_tokens, warmups=1):
    """`requests` requests from `concurrency` clients in turn; the figures and the wall time."""
    todo = list(range(requests))
    results = []

    async def client(session):
        while todo:
            i = todo.pop()
            results.append(await one_request(session, url, PROMPTS[i % len(PROMPTS)], max_tokens))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        # warm-up: one request per replica at once (each replica goes to the shortest queue)
        await asyncio.gather(*(one_request(session, url, PROMPTS[0], max_tokens) for _ in range(warmups)))
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft, tpot, tokens = zip(*results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "token_p50_ms": 1e3 * percentile(tpot, 0.5),
        "token_p99_ms": 1e3 * percentile(tpot, 0.99),
        "tokens_per_s": sum(tokens) / wall,
    }


def start_server(method, replicas, serve_args):
    cmd = [
        sys.executable,
        "-c",
        "from dtrt.cli import main; main()",
        "serve",
        "--port",
        "0",
        "--method",
        method,
        *([] if replicas == "process" else ["--replicas", replicas]),
        *serve_args,
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if m := re.search(r" on (http://\S+)", line):
            # keep reading what it logs, so that a full pipe never blocks it
            threading.Thread(
                target=lambda: [print(x, end="", file=sys.stderr) for x in proc.stderr], daemon=True
            ).start()
            return proc, m[1]
        print(line, end="", file=sys.stderr)
    raise SystemExit(f"dtrt serve --method {method} --replicas {replicas} did not start (exit {proc.wait()})")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="measure this running server instead of starting one per method")
    ap.add_argument("--methods", default="dominotree,ar", help="comma list; one server each")
    ap.add_argument(
        "--replicas",
        default="process",
        help="comma list: process (the single-process server) and replica counts on Ray Serve; one server each",
    )
    ap.add_argument("--concurrency", default="1,2,4", help="comma list of concurrent clients")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="the server's --threads (per replica)")
    ap.add_argument("--json", dest="json_out", help="write the rows to this file")
    args, serve_args = ap.parse_known_args()  # anything else goes to `dtrt serve` (--model, --backend, ...)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    if args.url:
        targets = [(None, None, args.url)]
    else:
        targets = [(m, r, None) for m in args.methods.split(",") for r in args.replicas.split(",")]
    for method, replicas, url in targets:
        proc = None
        if url is None:
            proc, url = start_server(method, replicas, [*serve_args, "--threads", str(args.threads)])
        warmups = 1 if replicas in (None, "process") else int(replicas)
        try:
            for c in levels:
                figures = asyncio.run(load(url, c, args.requests, args.max_tokens, warmups))
                row = {"method": method or "server", "replicas": replicas or "?"} | figures
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
        finally:
            if proc is not None:
                stop_server(proc)
    print("| method | replicas | clients | TTFT p50 | TTFT p99 | per token p50 | per token p99 | tok/s (all clients) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["method"], r["concurrency"], str(r["replicas"]))):
        print(
            f"| {r['method']} | {r['replicas']} | {r['concurrency']} | {r['ttft_p50_ms']:.1f} ms | "
            f"{r['ttft_p99_ms']:.1f} ms | {r['token_p50_ms']:.2f} ms | {r['token_p99_ms']:.2f} ms | "
            f"{r['tokens_per_s']:.0f} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Prompt lookup's index cost (dtrt.tree.lookup): building it over a prompt (once per request, with the prefill) and
one round (the round's committed tokens appended, then a proposal) at a given context length.

Streams: `random` (uniform over a 49,152-token vocabulary: almost nothing repeats), `zipf` (a Zipf draw over
the same vocabulary: short matches everywhere, as text has), `periodic` (a 97-token block repeated: every suffix
matches, long chains) and `constant` (one token: its n-grams occur at every position).

    python benchmarks/lookup_index.py
    python benchmarks/lookup_index.py --context 8192 --rounds 2000 --chain 16 --commit 4 --json out.json
"""

import argparse
import json
import statistics
import time

import numpy as np

from dtrt.tree.lookup import LookupIndex

VOCAB = 49_152


def stream(kind: str, n: int, rng) -> list[int]:
    if kind == "random":
        return rng.integers(0, VOCAB, n).tolist()
    if kind == "zipf":
        return (rng.zipf(1.2, n) % VOCAB).tolist()
    if kind == "periodic":
        return (rng.integers(0, VOCAB, 97).tolist() * (n // 97 + 1))[:n]
    return [7] * n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens before the timed rounds")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--chain", type=int, default=16, help="proposal length (--budget)")
    ap.add_argument("--commit", type=int, default=4, help="tokens each round appends")
    ap.add_argument("--alternatives", type=int, default=1)
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    for kind in ("random", "zipf", "periodic", "constant"):
        tokens = stream(kind, a.context + a.rounds * a.commit, rng)
        t0 = time.perf_counter()
        index = LookupIndex(tokens[: a.context])
        build_s = time.perf_counter() - t0
        times, matched = [], 0
        for r in range(a.rounds):
            piece = tokens[a.context + r * a.commit : a.context + (r + 1) * a.commit]
            t0 = time.perf_counter()
            index.extend(piece)
            chains = index.propose(max_len=a.chain, n_alternatives=a.alternatives)
            times.append(time.perf_counter() - t0)
            matched += bool(chains)
        times.sort()
        results[kind] = {
            "build_ms": 1e3 * build_s,
            "round_us_median": 1e6 * statistics.median(times),
            "round_us_p99": 1e6 * times[int(0.99 * len(times)) - 1],
            "rounds_matched": matched / a.rounds,
        }
        r = results[kind]
        print(
            f"{kind:9s} build {r['build_ms']:6.1f} ms  round median {r['round_us_median']:6.1f} us  "
            f"p99 {r['round_us_p99']:6.1f} us  matched {r['rounds_matched']:.0%}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""What /metrics reports: requests by outcome, queue length, and over the last requests tau, tok/s and time to
first token, as Prometheus text (or JSON); with replicas, the same per replica beside the totals."""

import math
import threading
from collections import Counter, deque

WINDOW = 256  # requests the rates and percentiles are taken over
OUTCOMES = ("ok", "cancelled", "timeout", "rejected", "error")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.outcomes = Counter()
        self.tokens_total = 0
        self.recent = deque(maxlen=WINDOW)  # (ttft_s, tokens, rounds, accepted, decode_s) of finished generations

    def finished(self, outcome: str, completion=None, ttft_s: float | None = None):
        with self._lock:
            self.outcomes[outcome] += 1
            if completion is not None:
                gen = completion.generation
                self.tokens_total += len(gen.tokens)
                self.recent.append(
                    (ttft_s, len(gen.tokens), len(gen.rounds), sum(r.accepted for r in gen.rounds), gen.decode_s)
                )

    def snapshot(self, waiting: int, running: int, prefix_cache: dict | None = None) -> dict:
        with self._lock:
            recent = list(self.recent)
            outcomes = {k: self.outcomes[k] for k in OUTCOMES}
            tokens_total = self.tokens_total
        ttft = [r[0] for r in recent if r[0] is not None]
        rounds, decode_s = sum(r[2] for r in recent), sum(r[4] for r in recent)
        return {
            "requests": outcomes,
            "queue_length": waiting,
            "in_flight": running,
            "generated_tokens": tokens_total,
            "window": len(recent),
            "tau": sum(r[3] for r in recent) / rounds if rounds else 0.0,
            "tokens_per_s": sum(r[1] for r in recent) / decode_s if decode_s > 0 else 0.0,
            "ttft_s": {
                "p50": percentile(ttft, 0.5),
                "p99": percentile(ttft, 0.99),
                "sum": sum(ttft),
                "count": len(ttft),
            },
        } | ({"prefix_cache": prefix_cache} if prefix_cache is not None else {})


def prometheus(snap: dict) -> str:
    lines = ["# HELP dtrt_requests_total Finished requests by outcome.", "# TYPE dtrt_requests_total counter"]
    lines += [f'dtrt_requests_total{{outcome="{k}"}} {v}' for k, v in snap["requests"].items()]
    gauges = (
        ("queue_length", "Requests waiting (admitted, not generating yet).", snap["queue_length"]),
        ("in_flight", "Requests generating now (at most one per replica).", snap["in_flight"]),
        ("tau", f"Mean tokens committed per verify round over the last {WINDOW} requests.", snap["tau"]),
        ("tokens_per_second", f"Generated tokens over decode time, last {WINDOW} requests.", snap["tokens_per_s"]),
    )
    for name, doc, value in gauges:
        lines += [f"# HELP dtrt_{name} {doc}", f"# TYPE dtrt_{name} gauge", f"dtrt_{name} {value}"]
    lines += [
        "# HELP dtrt_generated_tokens_total Tokens generated.",
        "# TYPE dtrt_generated_tokens_total counter",
        f"dtrt_generated_tokens_total {snap['generated_tokens']}",
        "# HELP dtrt_time_to_first_token_seconds Queue wait + prefill, last requests.",
        "# TYPE dtrt_time_to_first_token_seconds summary",
    ]
    ttft = snap["ttft_s"]
    lines += [
        f'dtrt_time_to_first_token_seconds{{quantile="{q}"}} {ttft[k]}' for q, k in (("0.5", "p50"), ("0.99", "p99"))
    ]
    lines += [
        f"dtrt_time_to_first_token_seconds_sum {ttft['sum']}",
        f"dtrt_time_to_first_token_seconds_count {ttft['count']}",
    ]
    if "prefix_cache" in snap:
        lines += _prefix_cache(snap["prefix_cache"])
    if "replicas" in snap:
        lines += _replicas(snap)
    return "\n".join(lines) + "\n"


def _replicas(snap: dict) -> list[str]:
    """Per-replica series (their own names, so that summing a series never counts a request twice)."""
    live = [r for r in snap["replicas"] if r["alive"]]
    lines = [
        "# HELP dtrt_replicas Replicas serving (reported within the last seconds).",
        "# TYPE dtrt_replicas gauge",
        f"dtrt_replicas {len(live)}",
        "# HELP dtrt_retried_total Requests sent again because their replica stopped.",
        "# TYPE dtrt_retried_total counter",
        f"dtrt_retried_total {snap['retried']}",
        "# HELP dtrt_replica_requests_total Finished requests by replica and outcome.",
        "# TYPE dtrt_replica_requests_total counter",
    ]
    label = [f'replica="{r["replica"]}",pid="{r["pid"]}",node="{r["node"]}"' for r in live]
    for r, lab in zip(live, label):
        lines += [f'dtrt_replica_requests_total{{{lab},outcome="{k}"}} {v}' for k, v in r["requests"].items()]
    for key, name, doc in (
        ("queue_length", "queue_length", "Requests waiting on the replica."),
        ("in_flight", "in_flight", "Requests generating on the replica (0 or 1)."),
        ("tau", "tau", f"Mean tokens per verify round on the replica, last {WINDOW} requests."),
        ("tokens_per_s", "tokens_per_second", f"Tokens over decode time on the replica, last {WINDOW} requests."),
        ("generated_tokens", "generated_tokens_total", "Tokens generated by the replica."),
    ):
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP dtrt_replica_{name} {doc}", f"# TYPE dtrt_replica_{name} {kind}"]
        lines += [f"dtrt_replica_{name}{{{lab}}} {r[key]}" for r, lab in zip(live, label)]
    return lines


PREFIX_CACHE = (  # (key, name, kind, help) of dtrt.runtime.prefix_cache.PrefixCache.snapshot
    ("lookups", "lookups_total", "counter", "Requests that looked for a cached prompt prefix."),
    ("hits", "hits_total", "counter", "Requests that restored a cached prompt prefix."),
    ("hit_tokens", "hit_tokens_total", "counter", "Prompt tokens restored instead of prefilled."),
    ("saved_s", "saved_seconds_total", "counter", "Prefill seconds the restored tokens took, less the restores."),
    ("evictions", "evictions_total", "counter", "Snapshots dropped, least recently used first, to fit the limit."),
    ("fills", "fills_total", "counter", "Answered conversations prefilled into the cache while idle."),
    ("interrupted", "interrupted_total", "counter", "Of those, cut short by a waiting request (its part kept)."),
    ("entries", "entries", "gauge", "Snapshots held."),
    ("bytes", "bytes", "gauge", "Bytes the snapshots hold."),
    ("limit_bytes", "limit_bytes", "gauge", "--prefix-cache-mb in bytes."),
)


def summed_caches(snaps: list[dict]) -> dict | None:
    """The prefix caches of several replicas' snapshots as one: every series summed (None: no replica has one)."""
    caches = [s["prefix_cache"] for s in snaps if "prefix_cache" in s]
    if not caches:
        return None
    return {key: sum(c.get(key, 0) for c in caches) for key, *_ in PREFIX_CACHE}


def _prefix_cache(cache: dict) -> list[str]:
    lines = []
    for key, name, kind, doc in PREFIX_CACHE:
        lines += [f"# HELP dtrt_prefix_cache_{name} {doc}", f"# TYPE dtrt_prefix_cache_{name} {kind}"]
        lines.append(f"dtrt_prefix_cache_{name} {cache[key]}")
    return lines

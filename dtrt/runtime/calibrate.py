"""CaDDTree's cost model, measured on the running backend: verify latency against tree width at the current
and at the largest context of this generation, and the drafter's block latency."""

import statistics
import time

from dtrt.tree.caddtree import CostCurve


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_cost_curve(backend, max_nodes: int, repeats: int = 3) -> CostCurve:
    widths = sorted({1 << i for i in range(max_nodes.bit_length() + 1) if 1 << i <= max_nodes + 1} | {max_nodes + 1})
    far = backend.capacity - widths[-1]
    contexts = sorted({backend.past, max(backend.past, far)})
    samples = {}
    for ctx in contexts:
        backend.time_verify(widths[-1], ctx)  # warm-up at this context
        samples[ctx] = [
            (w - 1, _median_time(lambda w=w, ctx=ctx: backend.time_verify(w, ctx), repeats)) for w in widths
        ]
    draft_cost = _median_time(backend.time_draft, repeats)
    return CostCurve.fit(samples, draft_cost)

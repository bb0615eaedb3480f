"""CaDDTree: DDTree with a per-round budget chosen by a cost-aware stopping rule.

A node is admitted while it raises the surrogate throughput
    θ(n) = (1 + Φ(n)) / (C_d + C_v(n; ℓ)),     Φ(n) = Σ exp(logw) over the n admitted nodes,
where C_d is the draft cost and C_v(n; ℓ) the measured cost of verifying n draft nodes (width n + 1) at
context length ℓ.
"""

import bisect
import math
import statistics
from dataclasses import dataclass


@dataclass
class CostCurve:
    """C_v(n; ℓ) as piecewise-linear curves over n, one per measured context length, plus C_d."""

    contexts: list[int]  # ascending
    nodes: list[list[float]]  # per context: knot positions n, ascending
    seconds: list[list[float]]  # per context: C_v at the knots, non-decreasing and convex
    draft_cost: float  # C_d, seconds

    def __post_init__(self):
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError("contexts must be non-empty, ascending and distinct")
        if not len(self.contexts) == len(self.nodes) == len(self.seconds):
            raise ValueError("one knot list per context")
        for ns, ts in zip(self.nodes, self.seconds):
            if not ns or len(ns) != len(ts) or list(ns) != sorted(set(ns)):
                raise ValueError("each context needs ascending, distinct knots with one cost each")

    @classmethod
    def fit(cls, samples: dict[int, list[tuple[float, float]]], draft_cost: float) -> "CostCurve":
        """samples: context length -> [(n, seconds), ...]. Repeated n are reduced to their median, then
        each context gets the least-squares monotone fit and its lower convex hull."""
        contexts = sorted(samples)
        nodes, seconds = [], []
        for ctx in contexts:
            by_n: dict[float, list[float]] = {}
            for n, t in samples[ctx]:
                by_n.setdefault(float(n), []).append(float(t))
            if not by_n:
                raise ValueError(f"context {ctx}: no samples")
            ns = sorted(by_n)
            ts = _isotonic([statistics.median(by_n[n]) for n in ns], [len(by_n[n]) for n in ns])
            hull = _lower_hull(list(zip(ns, ts)))
            nodes.append([n for n, _ in hull])
            seconds.append([t for _, t in hull])
        return cls(contexts, nodes, seconds, float(draft_cost))

    def verify_cost(self, n: float, context_len: int) -> float:
        """C_v(n; ℓ): linear in n between knots and beyond the last; linear in ℓ between the measured contexts and
        beyond the last (attention reads the past: a verify never gets cheaper with it), flat below the first."""
        ctx = self.contexts
        if context_len <= ctx[0] or len(ctx) == 1:
            return self._at(0 if context_len <= ctx[0] else len(ctx) - 1, n)
        i = min(bisect.bisect_right(ctx, context_len), len(ctx) - 1) - 1  # segment [i, i+1]; past the end, the last
        a = (context_len - ctx[i]) / (ctx[i + 1] - ctx[i])
        lo, hi = self._at(i, n), self._at(i + 1, n)
        return hi + max(hi - lo, 0.0) * (a - 1) if a > 1 else (1 - a) * lo + a * hi

    def to_json(self) -> dict:
        return {"contexts": self.contexts, "nodes": self.nodes, "seconds": self.seconds, "draft_cost": self.draft_cost}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        """The curve `to_json` wrote; ValueError for anything else."""
        try:
            curve = cls(
                [int(c) for c in data["contexts"]],
                [[float(x) for x in ns] for ns in data["nodes"]],
                [[float(x) for x in ts] for ts in data["seconds"]],
                float(data["draft_cost"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a cost curve: {e}") from None
        if not all(math.isfinite(t) and t >= 0 for ts in curve.seconds for t in ts) or not (
            math.isfinite(curve.draft_cost) and curve.draft_cost >= 0
        ):
            raise ValueError("a cost curve's seconds are finite and non-negative")
        return curve

    def _at(self, i: int, n: float) -> float:
        ns, ts = self.nodes[i], self.seconds[i]
        if n <= ns[0] or len(ns) == 1:  # below the first knot: flat (a cost never drops below it)
            return ts[0]
        j = min(bisect.bisect_right(ns, n), len(ns) - 1)  # segment [j-1, j]; past the end, the last one
        slope = (ts[j] - ts[j - 1]) / (ns[j] - ns[j - 1])
        return ts[j - 1] + slope * (n - ns[j - 1])


def _isotonic(y: list[float], w: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [m for m, _, c in blocks for _ in range(c)]


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of points sorted by x; of a non-decreasing sequence it stays non-decreasing."""
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (p[1] - y0) - (y1 - y0) * (p[0] - x0) > 0:
                break
            hull.pop()
        hull.append(p)
    return hull


@dataclass
class CostAwareStop:
    """The `stop` for build_ddtree: admit a candidate only while θ strictly increases."""

    curve: CostCurve
    context_len: int
    phi: float = 0.0
    theta: float = 0.0

    def start(self):
        self.phi = 0.0
        self.theta = 1.0 / (self.curve.draft_cost + self.curve.verify_cost(0, self.context_len))

    def admit(self, n_nodes: int, logw: float) -> bool:
        delta = math.exp(logw)
        theta = (1.0 + self.phi + delta) / (
            self.curve.draft_cost + self.curve.verify_cost(n_nodes + 1, self.context_len)
        )
        if theta <= self.theta:
            return False
        self.phi += delta
        self.theta = theta
        return True

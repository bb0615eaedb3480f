"""Speedup over AR with a paired bootstrap 95% confidence interval.

Each prompt gives one ratio, AR time per output token / the method's, measured on the same prompt; the
estimate is their mean, and the interval is the 2.5/97.5 percentiles of that mean over prompts resampled
with replacement, so the prompt-to-prompt spread in difficulty cancels within each pair."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Speedup:
    value: float
    low: float
    high: float
    n: int


def paired_bootstrap(ar_tpot, method_tpot, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> Speedup:
    ar, m = np.asarray(ar_tpot, dtype=np.float64), np.asarray(method_tpot, dtype=np.float64)
    if ar.shape != m.shape or ar.ndim != 1:
        raise ValueError(f"paired samples need equal 1-d shapes, got {ar.shape} and {m.shape}")
    if len(ar) == 0:
        return Speedup(float("nan"), float("nan"), float("nan"), 0)
    ratios = ar / m
    idx = np.random.default_rng(seed).integers(0, len(ratios), size=(n_boot, len(ratios)))
    means = ratios[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    value = float(ratios.mean())
    # the percentiles are interpolated; keep the interval around its own estimate when the spread is ~0
    return Speedup(value, float(min(low, value)), float(max(high, value)), len(ratios))

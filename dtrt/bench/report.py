"""bench.json (config, every record, the summary), bench.md (the table) and bench.png (the plot), each written
to a temporary name and then renamed, so a reader never sees half a file."""

import json
import math
import os
from pathlib import Path

from dtrt.bench.stats import paired_bootstrap

ALL = "all"


def key(r):
    return r["dataset"], r["temperature"], r["prompt_id"], r["turn"]


def summarize(records: list[dict], seed: int = 0) -> list[dict]:
    """One row per method x dataset (and `all`) x temperature: mean over prompts of the per-prompt tau and tok/s,
    speedup over AR with its paired bootstrap CI, and whether every T=0 output equals AR's."""
    ar = {key(r): r for r in records if r["method"] == "ar"}
    methods = list(dict.fromkeys(r["method"] for r in records))
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    temps = list(dict.fromkeys(r["temperature"] for r in records))
    rows = []
    for t in temps:
        for d in [*datasets, *([ALL] if len(datasets) > 1 else [])]:
            for m in methods:
                rs = [r for r in records if r["method"] == m and r["temperature"] == t and d in (ALL, r["dataset"])]
                if not rs:
                    continue
                # a generation that stopped at prefill (EOS first) has no decode time to compare
                pairs = [(ar[key(r)], r) for r in rs if key(r) in ar and ar[key(r)]["decode_s"] > 0 < r["decode_s"]]
                sp = paired_bootstrap([a["tpot_s"] for a, _ in pairs], [r["tpot_s"] for _, r in pairs], seed=seed)
                exact = None
                if t == 0 and m != "llama.cpp":
                    exact = all(key(r) in ar and r["tokens"] == ar[key(r)]["tokens"] for r in rs)
                timed = [r for r in rs if r["decode_s"] > 0 and r["rounds"]]
                rows.append(
                    {
                        "method": m,
                        "dataset": d,
                        "temperature": t,
                        "n": len(rs),
                        "tau": _mean([r["tau"] for r in timed]),
                        "tokens_per_s": _mean([r["tokens_per_s"] for r in timed]),
                        "speedup": sp.value,
                        "ci_low": sp.low,
                        "ci_high": sp.high,
                        "paired": sp.n,
                        "exact": exact,
                    }
                )
    return rows


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(rows: list[dict], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| method | dataset | T | n | tau | tok/s | speedup [95% CI] | = AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = "n/a" if math.isnan(r["speedup"]) else f"{r['speedup']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
        exact = {None: "", True: "yes", False: "**no**"}[r["exact"]]
        lines.append(
            f"| {r['method']} | {r['dataset']} | {r['temperature']:g} | {r['n']} | {r['tau']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {sp} | {exact} |"
        )
    return "\n".join(lines) + "\n"


def _atomic(path: Path, write):
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, report: dict):
    _atomic(path, lambda p: p.write_text(json.dumps(report, indent=1)))


def write_markdown(path: Path, text: str):
    _atomic(path, lambda p: p.write_text(text))


def write_plot(path: Path, rows: list[dict], title: str) -> bool:
    """Speedup with its CI and tau per dataset, one column per temperature; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(
        2, len(temps), figsize=(1.2 + 0.6 * len(datasets) * len(methods) * len(temps) / 2, 6), squeeze=False
    )
    width = 0.8 / len(methods)
    for col, t in enumerate(temps):
        for j, m in enumerate(methods):
            got = {r["dataset"]: r for r in rows if r["temperature"] == t and r["method"] == m}
            xs = [i + (j - (len(methods) - 1) / 2) * width for i, d in enumerate(datasets) if d in got]
            rs = [got[d] for d in datasets if d in got]
            sp = [r["speedup"] for r in rs]
            err = [[r["speedup"] - r["ci_low"] for r in rs], [r["ci_high"] - r["speedup"] for r in rs]]
            axes[0][col].bar(xs, sp, width, yerr=err, capsize=2, label=m)
            axes[1][col].bar(xs, [r["tau"] for r in rs], width, label=m)
        for row, name in enumerate(("speedup over AR", "tau")):
            ax = axes[row][col]
            ax.set_xticks(range(len(datasets)), datasets)
            ax.set_ylabel(name)
            ax.axhline(1.0, color="gray", lw=0.8)
        axes[0][col].set_title(f"T = {t:g}")
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(title)
    fig.tight_layout()
    _atomic(path, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)
    return True

"""bench.json (the command, the machine line, the config and the summary), bench.md (the table) and bench.png (the
plot), each written to a temporary name and then renamed, so a reader never sees half a file."""

import io
import json
import math
import os
import textwrap
from pathlib import Path

from dtrt.bench.stats import paired_bootstrap
from dtrt.runtime.generate import STAGES

ALL = "all"


def key(r):
    return r["dataset"], r["temperature"], r["prompt_id"], r["turn"]


def group(r) -> tuple:
    """What a row's AR must share with it: the target's quantization and the --graphs mode."""
    return r.get("quant"), r.get("captured", False)


def summarize(records: list[dict], seed: int = 0, *, quants: list | None = None) -> list[dict]:
    """One row per method x dataset (and `all`) x temperature: mean over prompts of the per-prompt tau and tok/s,
    speedup over AR with its paired bootstrap CI, whether every T=0 output equals AR's, and the share of the
    accepted draft tokens that came from prompt lookup (pooled_lookup_share). A row is paired with the AR of its own
    quantization and --graphs mode (a record's `quant` and `captured`); a peer (llama.cpp) with the first AR of the
    first of `quants` (the grid's, in order; None: the first AR record's). Where the run has a peer row, each of
    dtrt's rows also carries its speed over the peer's on the same prompts (`vs_peer`: the peer's time per token
    over the row's, with its paired CI)."""
    ars = [r for r in records if r.get("base_method", r["method"]) == "ar"]
    ar = {(*group(r), *key(r)): r for r in ars}
    firsts = [group(r) for r in ars if not quants or r.get("quant") == quants[0]]
    first = firsts[0] if firsts else (quants[0] if quants else None, False)

    def own_ar(r):
        return ar.get((*(first if r["method"] in PEERS else group(r)), *key(r)))

    peer = {key(r): r for r in records if r["method"] in PEERS}

    def versus(other, rs):
        """The paired bootstrap of the records `rs` against `other(r)`, each the same prompt's record of another row
        (a generation that stopped at prefill, EOS first, has no decode time to compare)."""
        pairs = [(other(r), r) for r in rs if other(r) and other(r)["decode_s"] > 0 < r["decode_s"]]
        return paired_bootstrap([o["tpot_s"] for o, _ in pairs], [r["tpot_s"] for _, r in pairs], seed=seed)

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
                sp = versus(own_ar, rs)
                exact = None
                if t == 0 and m not in PEERS:
                    exact = all(own_ar(r) and r["tokens"] == own_ar(r)["tokens"] for r in rs)
                timed = [r for r in rs if r["decode_s"] > 0 and r["rounds"]]
                vs_peer = None
                if peer and m not in PEERS:
                    vp = versus(lambda r: peer.get(key(r)), rs)
                    vs_peer = {"value": vp.value, "low": vp.low, "high": vp.high, "paired": vp.n}
                rows.append(
                    {
                        "method": m,
                        "quant": rs[0].get("quant"),
                        "captured": rs[0].get("captured", False),
                        "compiled": rs[0].get("compiled", False),
                        "builder": rs[0].get("builder"),
                        "draft_graph": rs[0].get("draft_graph", False),
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
                        "round_ms": round_ms(timed),
                        "lookup_share": pooled_lookup_share(rs),
                        "vs_peer": vs_peer,
                    }
                )
    return rows


def round_ms(records: list[dict]) -> dict[str, float] | None:
    """The mean milliseconds a round spends in each stage (draft, build, verify, commit) over all the records'
    rounds; None for records without stage times (a peer contender)."""
    timed = [r for r in records if r.get("stage_s") and r["rounds"]]
    rounds = sum(r["rounds"] for r in timed)
    if not rounds:
        return None
    return {k: 1000 * sum(r["stage_s"].get(k, 0.0) for r in timed) / rounds for k in STAGES}


def lookup_share(accepted: list[int], from_lookup: list[int]) -> float | None:
    """The share of a generation's accepted draft tokens that came from prompt lookup: its rounds' `from_lookup`
    over their accepted draft tokens (`accepted` - 1 a round: the bonus token is the target's); None where no draft
    was accepted."""
    drafts = sum(a - 1 for a in accepted)
    return sum(from_lookup) / drafts if drafts else None


def pooled_lookup_share(records: list[dict]) -> float | None:
    """A row's lookup share: its records' accepted draft tokens from lookup over all their accepted draft tokens,
    summed over the records that carry a share (those of a row drafting from lookup: `lookup`, `--lookup`). None
    for a row without lookup nodes (ar, dominotree without --lookup, a peer) and for records written by a dtrt
    that did not record the share."""
    shared = [r for r in records if r.get("lookup_share") is not None]
    return lookup_share([a for r in shared for a in r["accepted"]], [n for r in shared for n in r["from_lookup"]])


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(rows: list[dict], title: str, failed: dict | None = None, note: str | None = None) -> str:
    """The table, with the conditions of the timings (`note`) and a line per peer row that failed. `lookup share`:
    the row's lookup share (pooled_lookup_share), `-` where it has none; `vs llama.cpp`, where the run has that peer
    row: each row's speed over the peer's on the same prompts, paired."""
    lines = [f"### {title}", ""]
    if note:
        lines += [note, ""]
    with_peer = any(r.get("vs_peer") for r in rows)
    peer_head = f" vs {PEERS[0]} [95% CI] |" if with_peer else ""
    lines += [
        f"| method | dataset | T | n | tau | lookup share | tok/s | speedup [95% CI] | = AR | "
        f"ms a round ({' / '.join(STAGES)}) |{peer_head}",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_peer else ""),
    ]
    for r in rows:
        sp = "n/a" if math.isnan(r["speedup"]) else f"{r['speedup']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"
        exact = {None: "", True: "yes", False: "**no**"}[r["exact"]]
        ms = " / ".join(f"{r['round_ms'][k]:.2f}" for k in STAGES) if r.get("round_ms") else ""
        share = "-" if r.get("lookup_share") is None else f"{r['lookup_share']:.0%}"
        vp = r.get("vs_peer")
        peer = ""
        if with_peer:
            peer = (
                " |"
                if not vp or math.isnan(vp["value"])
                else f" {vp['value']:.2f} [{vp['low']:.2f}, {vp['high']:.2f}] |"
            )
        lines.append(
            f"| {r['method']} | {r['dataset']} | {r['temperature']:g} | {r['n']} | {r['tau']:.2f} | {share} | "
            f"{r['tokens_per_s']:.1f} | {sp} | {exact} | {ms} |{peer}"
        )
    for label, why in (failed or {}).items():
        lines.append(f"| {label} | failed: {why} | | | | | | | | |" + (" |" if with_peer else ""))
    return "\n".join(lines) + "\n"


def _atomic(path: Path, write):
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json(path: Path, report: dict):
    _atomic(path, lambda p: p.write_text(json.dumps(report, indent=1)))


def write_markdown(path: Path, text: str):
    _atomic(path, lambda p: p.write_text(text))


PEERS = ("llama.cpp",)  # other contenders: drawn apart from dtrt's methods


def plot_layout(temps: int, datasets: list[str], methods: int, title: str) -> dict:
    """Figure size and label placement from the grid: one column, a speedup and a tau panel per temperature, each
    dataset group as wide as its bars need, dataset names turned only when they would not fit under their group,
    and the title wrapped to the figure's width."""
    group = max(0.9, 0.28 * methods + 0.3)  # inches per dataset group
    width = min(18.0, max(6.0, 1.2 + group * len(datasets) + 2.6))  # 2.6: the legend at the right
    chars_per_group = group * 11  # about 11 characters of tick label per inch
    rotate = 30 if max(len(d) for d in datasets) > chars_per_group else 0
    return {"size": (width, 0.9 + 2.7 * 2 * temps), "rotate": rotate, "title": textwrap.fill(title, int(width * 10))}


def write_plot(path: Path, rows: list[dict], title: str) -> bool:
    """bench.png (plot_figure) in 256 colours, a third of the bytes of matplotlib's RGBA for the same picture;
    False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(rows, title)
    _atomic(path, lambda p: save_png(fig, p))
    plt.close(fig)
    return True


def save_png(fig, path: Path):
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)


def plot_figure(rows: list[dict], title: str):
    """Speedup with its CI and tau per dataset, one column per temperature, peers (llama.cpp) hatched and labelled
    as another contender."""
    import matplotlib.pyplot as plt

    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    layout = plot_layout(len(temps), datasets, len(methods), title)
    fig, axes = plt.subplots(2 * len(temps), 1, figsize=layout["size"], squeeze=False, layout="constrained")
    panels = {(t, metric): axes[2 * i + metric][0] for i, t in enumerate(temps) for metric in (0, 1)}
    width = 0.8 / len(methods)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for t in temps:
        for j, m in enumerate(methods):
            got = {r["dataset"]: r for r in rows if r["temperature"] == t and r["method"] == m}
            xs = [i + (j - (len(methods) - 1) / 2) * width for i, d in enumerate(datasets) if d in got]
            rs = [got[d] for d in datasets if d in got]
            peer = m in PEERS
            style = {"color": "0.75", "hatch": "//", "edgecolor": "0.35"} if peer else {"color": colors[j % 10]}
            label = f"{m} (another contender)" if peer else m
            sp = [r["speedup"] for r in rs]
            err = [[r["speedup"] - r["ci_low"] for r in rs], [r["ci_high"] - r["speedup"] for r in rs]]
            panels[t, 0].bar(xs, sp, width, yerr=err, capsize=2, label=label, **style)
            panels[t, 1].bar(xs, [r["tau"] for r in rs], width, label=label, **style)
        for metric, name in enumerate(("speedup over AR", "tau")):
            ax = panels[t, metric]
            ax.set_xticks(range(len(datasets)), datasets, rotation=layout["rotate"],
                          ha="right" if layout["rotate"] else "center")  # fmt: skip
            ax.set_ylabel(f"{name}, T = {t:g}")
            ax.axhline(1.0, color="gray", lw=0.8)
    axes[0][0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(layout["title"])
    return fig

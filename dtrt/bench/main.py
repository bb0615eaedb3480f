"""`dtrt bench` from parsed options to the three output files."""

import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dtrt import __version__
from dtrt.bench import datasets, engines, report, runner
from dtrt.errors import DtrtError
from dtrt.runtime.methods import METHODS
from dtrt.runtime.pipeline import default_budget, load_sources

QUICK_PROMPTS, QUICK_TOKENS = 2, 32


@dataclass
class BenchOptions:
    model: str | None = None
    target: str | None = None
    drafter: str | None = None
    model_dir: str | None = None
    backend: str | None = None  # None: as `dtrt run` (source_defaults)
    export: str | None = None
    methods: str | None = None  # comma list; None = every method the pair serves
    datasets: str = "mt-bench,humaneval,math500,aime"
    temperatures: str = "0,1"
    prompts: int = 20
    max_new_tokens: int = 128
    budget: str | None = None
    seed: int = 0
    quick: bool = False
    out: str = "bench-results"
    threads: int | None = None
    dtype: str | None = None
    gguf: str | None = None
    device: str | None = None  # torch backend: cpu or cuda[:N]
    cuda_graph: bool = False  # dominotree rows replay drafting + tree building as one CUDA graph


def _split(flag: str, text: str, convert, allowed=None) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise DtrtError(f"{flag} {text!r}: give a comma-separated list")
    out = []
    for s in items:
        if allowed is not None and s not in allowed:
            raise DtrtError(f"{flag} {s!r}: use some of {', '.join(allowed)}")
        try:
            out.append(convert(s))
        except ValueError:
            raise DtrtError(f"{flag} {s!r}: not a {convert.__name__}") from None
    return list(dict.fromkeys(out))


def bench(o: BenchOptions, log) -> Path:
    methods = _split("--methods", o.methods, str, METHODS) if o.methods else list(METHODS)
    names = _split("--datasets", o.datasets, str, datasets.DATASETS)
    temps = _split("--temperatures", o.temperatures, float)
    budgets = _split("--budget", o.budget, int) if o.budget is not None else []
    if any(t < 0 for t in temps) or any(b < 1 for b in budgets):
        raise DtrtError("--temperatures must be >= 0 and --budget >= 1")
    n, max_new = (QUICK_PROMPTS, QUICK_TOKENS) if o.quick else (o.prompts, o.max_new_tokens)
    if o.quick:
        temps = temps[:1]
    if n < 1 or max_new < 2:
        raise DtrtError("--prompts must be >= 1 and --max-new-tokens >= 2 (the first token comes from prefill)")
    prompts = {d: datasets.load(d, n, o.seed) for d in names}  # missing packages fail before any model loads
    pair, model, backend = load_sources(o.model, o.target, o.drafter, o.model_dir, o.backend, o.export, log, o.device)
    o = replace(o, model=model, backend=backend)
    budgets = budgets or [default_budget(model)]
    gguf = engines.find_gguf(o.gguf, o.model)

    if o.threads:
        torch.set_num_threads(o.threads)
    engs = engines.dtrt_engines(
        pair,
        methods,
        budgets,
        o.methods is not None,
        o.dtype,
        o.backend,
        o.export,
        o.threads,
        o.model,
        log,
        o.device,
        o.cuda_graph,
    )
    peer = engines.llamacpp_engine(gguf, engs[0].tokenizer, o.threads, max_new, log)
    engs += [peer] if peer else []
    log(
        f"bench: {', '.join(e.label for e in engs)} on {', '.join(f'{d} ({len(p)})' for d, p in prompts.items())}"
        f" at T={','.join(f'{t:g}' for t in temps)}, {max_new} new tokens"
    )

    t0 = time.perf_counter()
    runner.warm_up(engs, log)
    records = runner.run(engs, prompts, runner.BenchConfig(temps, max_new, o.seed), log)
    rows = report.summarize(records, o.seed)

    model = o.model or (Path(o.target).name if o.target else Path(o.export).name if o.export else "tiny")
    where = f" on {o.device}" if o.device and o.device != "cpu" else ""
    title = f"dtrt bench: {model}, {o.backend}{where}, {max_new} new tokens"
    config = {
        **vars(o),
        "datasets": names,
        "temperatures": temps,
        "budgets": budgets,
        "prompts": n,
        "max_new_tokens": max_new,
        "methods": [e.label for e in engs],
        "gguf": str(gguf) if peer else None,
        "dtrt": __version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "bench.json", {"config": config, "summary": rows, "records": records})
    report.write_markdown(out / "bench.md", report.markdown(rows, title))
    if not report.write_plot(out / "bench.png", rows, title):
        log('bench.png skipped: matplotlib is not installed (pip install -e ".[bench]")')
    return out

"""`dtrt bench` from parsed options to the three output files."""

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrt import __version__
from dtrt.bench import datasets, engines, report, runner
from dtrt.errors import DtrtError
from dtrt.launch import open_sources
from dtrt.runtime.requests import FLAGS, check_thinking, make_request
from dtrt.runtime.spec import BUDGET_METHODS, METHODS

QUICK_PROMPTS, QUICK_TOKENS = 2, 32


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """`dtrt bench`'s flags: the sources as `dtrt run` takes them, and the grid."""

    model: str | None = None
    target: str | None = None
    drafter: str | None = None
    model_dir: str | None = None
    backend: str | None = None  # None: as `dtrt run` (dtrt.launch.resolve)
    export: str | None = None
    dtype: str | None = None
    threads: int | None = None
    device: str | None = None  # cpu or cuda[:N]
    methods: str | None = None  # comma list; None = every method the pair serves
    dataset_names: str = "mt-bench,humaneval,math500,aime"
    temperatures: str = "0,1"
    prompts: int = 20
    max_new_tokens: int = 128
    budget: str | None = None  # one budget or a sweep; None: the model's
    seed: int = 0
    quick: bool = False
    out: str = "bench-results"
    cuda_graph: bool = False  # dominotree rows replay drafting + tree building as one CUDA graph
    gguf: str | None = None
    thinking: bool = False  # the chat template's thinking mode (Qwen3's enable_thinking), as `dtrt run --thinking`

    @property
    def sources(self) -> dict:
        """The flags resolve_spec takes."""
        keys = ("model", "target", "drafter", "model_dir", "backend", "export", "dtype", "threads", "device")
        return {k: getattr(self, k) for k in keys}


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
    names = _split("--datasets", o.dataset_names, str, datasets.DATASETS)
    temps = _split("--temperatures", o.temperatures, float)
    budgets = _split("--budget", o.budget, int) if o.budget is not None else [None]
    n, max_new = (QUICK_PROMPTS, QUICK_TOKENS) if o.quick else (o.prompts, o.max_new_tokens)
    if o.quick:
        temps = temps[:1]
    if n < 1 or max_new < 2:
        raise DtrtError("--prompts must be >= 1 and --max-new-tokens >= 2 (the first token comes from prefill)")
    names_ = FLAGS | {"temperature": "--temperatures"}
    requests = [
        make_request(max_new_tokens=max_new, temperature=t, seed=o.seed, thinking=o.thinking, names=names_)
        for t in temps
    ]
    grid = engines.grid(o.sources, methods, budgets, o.cuda_graph)  # every spec checked before anything loads
    prompts = {d: datasets.load(d, n, o.seed) for d in names}  # missing packages fail before any model loads
    base = grid[0]
    gguf = engines.find_gguf(o.gguf, base.model)

    engs = engines.dtrt_engines(grid, open_sources(base, log), explicit=o.methods is not None, log=log)
    check_thinking(engs[0].tokenizer, o.thinking)
    peer = engines.llamacpp_engine(gguf, engs[0].tokenizer, o.threads, max_new, log)
    engs += [peer] if peer else []
    log(
        f"bench: {', '.join(e.label for e in engs)} on {', '.join(f'{d} ({len(p)})' for d, p in prompts.items())}"
        f" at T={','.join(f'{t:g}' for t in temps)}, {max_new} new tokens"
    )

    t0 = time.perf_counter()
    runner.warm_up(engs, log, o.thinking)
    records = runner.run(engs, prompts, requests, log)
    rows = report.summarize(records, o.seed)

    model = base.model or (base.target or base.export).name
    where = f" on {base.device}" if base.device != "cpu" else ""
    title = f"dtrt bench: {model}, {base.backend}{where}, {max_new} new tokens"
    config = {
        **vars(o),
        "model": base.model,
        "backend": base.backend,
        "datasets": names,
        "temperatures": temps,
        "budgets": sorted({s.budget for s in grid if s.method in BUDGET_METHODS}) or [base.budget],
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

"""`dtrt bench` from parsed options to its outputs (dtrt.bench.records: the run's directory)."""

import json
import platform
import shlex
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from dtrt import __version__, hugepages
from dtrt.bench import contenders, datasets, longctx, loop, machine, records, report
from dtrt.errors import DtrtError
from dtrt.frontend.requests import FLAGS, check_thinking, make_request
from dtrt.launch import open_sources
from dtrt.runtime.spec import METHODS, QUANTS

QUICK_PROMPTS, QUICK_TOKENS = 2, 32


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """`dtrt bench`'s flags: the sources as `dtrt run` takes them, and the grid."""

    model: str | None = None
    target: str | None = None
    drafter: str | None = None
    model_dir: str | None = None
    backend: str | None = None  # None: as `dtrt run` (dtrt.launch.start)
    export: str | None = None
    engines: str | None = None
    dtype: str | None = None
    quant: str | None = None  # the target's quantization (as `dtrt run --quant`), or a sweep; None: the model's
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
    graphs: str = "eager"  # comma list of eager, captured (--static-shapes rows, CUDA graphs on a GPU): a sweep
    compile: bool = True  # captured rows on CUDA run each layer's parts around attention compiled, as `dtrt run`
    lookup: bool | None = None  # dominotree and cadominotree rows also take prompt lookup's chains (None: the default)
    gguf: str | None = None
    thinking: bool = False  # the chat template's thinking mode (Qwen3's enable_thinking), as `dtrt run --thinking`
    peer_timeout: float = 900.0  # seconds a peer (llama.cpp) may take per generation before its row is failed
    resume: str | None = None  # an interrupted run's --out to continue
    context_bins: str | None = None  # prompt lengths in tokens for the long datasets; None: those that fit
    draft_vocab: str | None = None  # the drafter's vocabulary, as `dtrt run --draft-vocab`; None: the drafter's own

    @property
    def sources(self) -> dict:
        """The flags resolve_spec takes."""
        keys = (
            *("model", "target", "drafter", "model_dir", "backend", "export", "dtype", "quant", "threads", "device"),
            *("engines", "draft_vocab", "compile"),
        )
        return {k: getattr(self, k) for k in keys}


FLAG_NAMES = {"dataset_names": "--datasets"}
NOT_FLAGS = ("out", "resume")


def command_line(o: BenchOptions) -> str:
    """The `dtrt bench` command that runs `o`'s grid again into its --out: every flag whose value is not the
    default, in the order of BenchOptions."""
    words = ["dtrt", "bench"]
    for f in fields(BenchOptions):
        value = getattr(o, f.name)
        if f.name in NOT_FLAGS or value == f.default:
            continue
        flag = FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    return shlex.join([*words, "--out", str(o.out)])


def split_list(flag: str, text: str, convert, allowed=None) -> list:
    """A comma-list flag's items, converted and checked against `allowed`, duplicates dropped; one-line errors."""
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


def resumed(o: BenchOptions, given: set[str]) -> BenchOptions:
    """On --resume OUT: the flags of the run in OUT, with those given on this command line (which must not change
    the grid: bench() checks it)."""
    path = Path(o.resume) / records.RUN
    if not path.is_file():
        raise DtrtError(f"--resume {o.resume}: no {records.RUN} there, so it is not a bench run to continue")
    stored = json.loads(path.read_text()).get("options", {})
    known = {f.name for f in fields(BenchOptions)}
    merged = {k: v for k, v in stored.items() if k in known} | {k: getattr(o, k) for k in given if k in known}
    return replace(o, **merged, out=o.resume, resume=o.resume)


def bench(o: BenchOptions, log) -> Path:
    methods = split_list("--methods", o.methods, str, contenders.ROW_METHODS) if o.methods else list(METHODS)
    # a name or a prompts file, checked by load; a file's path that holds a comma is taken whole
    whole = Path(o.dataset_names).is_file()
    names = [o.dataset_names] if whole else split_list("--datasets", o.dataset_names, str)
    temps = split_list("--temperatures", o.temperatures, float)
    budgets = split_list("--budget", o.budget, int) if o.budget is not None else [None]
    quants = split_list("--quant", o.quant, str, QUANTS) if o.quant is not None else [None]
    if len(quants) > 1 and o.export is not None:
        raise DtrtError(
            f"--quant {','.join(quants)}: an --export holds one quantized target; give one --quant, or --model NAME "
            "(a first-use export per quantization)"
        )
    long_names = [d for d in names if d in datasets.LONG]
    bins = split_list("--context-bins", o.context_bins, int) if o.context_bins is not None else None
    if bins is not None and not long_names:
        raise DtrtError(
            f"--context-bins applies to the long-context datasets; add {' or '.join(datasets.LONG)} to --datasets"
        )
    n, max_new = (QUICK_PROMPTS, QUICK_TOKENS) if o.quick else (o.prompts, o.max_new_tokens)
    if o.quick:
        temps = temps[:1]
    if n < 1 or max_new < 2:
        raise DtrtError("--prompts must be >= 1 and --max-new-tokens >= 2 (the first token comes from prefill)")
    if not o.peer_timeout > 0:
        raise DtrtError(f"--peer-timeout {o.peer_timeout}: must be > 0")
    names_ = FLAGS | {"temperature": "--temperatures"}
    requests = [
        make_request(max_new_tokens=max_new, temperature=t, seed=o.seed, thinking=o.thinking, names=names_)
        for t in temps
    ]
    # every spec checked before any load
    modes = split_list("--graphs", o.graphs, str, contenders.GRAPHS)
    grid = contenders.grid(o.sources, methods, budgets, quants, o.cuda_graph, o.lookup, modes)
    # missing packages fail before any model loads
    prompts = {d: datasets.load(d, n, o.seed) for d in names if d not in datasets.LONG}
    docs = {d: datasets.documents(d) for d in long_names}
    base = grid[0]
    gguf = contenders.find_gguf(o.gguf, base.model)
    out = Path(o.out)
    if o.resume is None:
        records.check_new(out)

    # the contenders load before the grid is written: the long-context prompts are cut by the target's tokenizer to
    # bins that fit every contender's context
    lineup = contenders.dtrt_contenders(grid, _sources(grid, log), explicit=o.methods is not None, log=log)
    check_thinking(lineup[0].tokenizer, o.thinking)
    if long_names:
        tight = min((e.pipe for e in lineup), key=lambda p: _room(p, max_new))
        bins = longctx.resolve_bins(bins, tight, max_new, long_names)
        cut = longctx.prompts(docs, bins, lineup[0].tokenizer, n, o.seed, o.thinking, log)
        if not cut and not prompts:
            raise DtrtError(
                f"--datasets {','.join(long_names)}: no document fills any of the bins "
                f"{','.join(map(str, bins))}; give smaller ones with --context-bins"
            )
        prompts = _in_order(names, prompts, cut)
    plan = {
        "options": {k: v for k, v in asdict(o).items() if k not in ("out", "resume")},
        "grid": {
            "quant": list(dict.fromkeys(s.quant for s in grid)),
            "graphs": modes,
            "rows": contenders.labels(grid),
            "sources": {k: str(v) if v is not None else None for k, v in asdict(base).items() if k in SOURCE_KEYS},
            "prompts": {d: [p.id for p in ps] for d, ps in prompts.items()},
            "context_bins": bins if long_names else None,
            "temperatures": temps,
            "max_new_tokens": max_new,
            "seed": o.seed,
            "thinking": o.thinking,
            "threads": o.threads,
            "gguf": str(gguf) if gguf else None,
        },
    }
    done = records.start(out, plan, resume=o.resume is not None)
    if done:
        log(f"resuming {out}: {len(done)} records done")

    longest = max(bins) if long_names else 0
    peer = contenders.llamacpp_contender(
        gguf, lineup[0].tokenizer, o.threads, max_new, o.peer_timeout, out, log, longest
    )
    lineup += [peer] if peer else []
    threads = {
        "torch": torch.get_num_threads(),
        "onnxruntime": base.threads,
        **({"llama.cpp": o.threads} if peer else {}),
    }
    h_machine, load_before = machine.cpu(), machine.load()
    if base.backend == "onnxruntime" and base.device == "cpu":
        h_machine["attention"] = machine.ort_attention()
    log(
        f"bench: {', '.join(e.label for e in lineup)} on {', '.join(f'{d} ({len(p)})' for d, p in prompts.items())}"
        f" at T={','.join(f'{t:g}' for t in temps)}, {max_new} new tokens"
    )
    log(machine.describe(machine.hygiene(h_machine, threads, load_before, None)))

    model = base.model or (base.target or base.export or base.engines).name
    where = f" on {base.device}" if base.device != "cpu" else ""
    title = f"dtrt bench: {model}, {base.backend}{where}, {max_new} new tokens"
    log_ = records.RecordLog(out)
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    got: list[dict] = []
    try:
        loop.warm_up(lineup, log, o.thinking, failed)
        got = loop.run(lineup, prompts, requests, log, keep=log_.append,
                         done={loop.record_key(r): r for r in done}, failed=failed)  # fmt: skip
    except KeyboardInterrupt:
        got = log_.load()
        _write(out, got, failed, plan, title, o, _noted(h_machine, peer), threads, load_before, t0, log, partial=True)
        log(f"interrupted: {len(got)} records written to {out}; continue with `dtrt bench --resume {out}`")
        raise
    finally:
        if peer is not None:
            peer.close()
    _write(out, got, failed, plan, title, o, _noted(h_machine, peer), threads, load_before, t0, log)
    return out


def _noted(h_machine: dict, peer) -> dict:
    """The machine as the report describes it, with how the peer ran where not as asked (repacking off)."""
    return {**h_machine, "peer": peer.note} if peer is not None and peer.note else h_machine


def _sources(grid: list, log) -> dict:
    """The sources of each quantization of the grid (quant -> Sources): one first-use export each for a registry
    model on ONNX Runtime, the checkpoints loaded once."""
    opened = {}
    for spec in grid:
        if spec.quant not in opened:
            first = next(iter(opened.values()), None)
            opened[spec.quant] = open_sources(spec, log, pair=first.pair if first else None)
    return opened


def _in_order(names: list[str], prompts: dict, cut: dict) -> dict:
    """The prompts in --datasets' order, a long dataset's bins (NAME/LABEL) where its name was, ascending."""
    ordered = {}
    for d in names:
        if d in prompts:
            ordered[d] = prompts[d]
        ordered |= {k: v for k, v in cut.items() if k.startswith(f"{d}/")}
    return ordered


def _room(pipe, max_new: int) -> float:
    room = pipe.prompt_room(max_new)
    return float("inf") if room is None else room


SOURCE_KEYS = ("model", "target", "drafter", "export", "backend", "device", "dtype")


def _write(out, got, failed, plan, title, o, h_machine, threads, load_before, t0, log, partial=False):
    """bench.json, bench.md and bench.png from the records (all of them, or those done when interrupted), and the
    records packed (dtrt.bench.records)."""
    h_machine = {**h_machine, "host_memory": hugepages.describe()}  # after the runs: what the weights lay in
    hygiene = machine.hygiene(h_machine, threads, load_before, machine.load())
    line = machine.describe(hygiene)
    log(line)
    rows = report.summarize(got, o.seed, quants=plan["grid"]["quant"])
    config = {
        **plan["options"],
        **plan["grid"],
        "methods": plan["grid"]["rows"] + (["llama.cpp"] if plan["grid"]["gguf"] else []),
        "prompts": len(next(iter(plan["grid"]["prompts"].values()), [])),
        "dtrt": __version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "hygiene": hygiene,
        "wall_s": time.perf_counter() - t0,
        "partial": partial,
    }
    command = command_line(replace(o, out=str(out), resume=None))
    summary = {"command": command, "machine": line, "config": config, "failed": failed, "summary": rows}
    report.write_json(out / records.REPORT, summary)
    records.RecordLog(out).pack()
    note = f"command: `{command}`\n\n{line}" + ("\n\n(interrupted: partial results)" if partial else "")
    report.write_markdown(out / "bench.md", report.markdown(rows, title, failed, note))
    if rows and not report.write_plot(out / "bench.png", rows, title):
        log('bench.png skipped: matplotlib is not installed (pip install -e ".[bench]")')

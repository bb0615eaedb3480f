"""Costs at Qwen3-4B and Qwen3-8B shapes on the torch backend, random weights, eager against static shapes (captured
in CUDA graphs on a GPU, with the layers' ops as they are and compiled) side by side, inside a wall-clock budget:

    build   per model (--models), the target (Qwen/Qwen3-4B's, Qwen/Qwen3-8B's config) and a Domino-b16 drafter
            (5 layers, 5 taps, G 1024, E 256) parsed from their config.json as released and made on the device with
            random weights (bf16 on CUDA, fp32 on the CPU); nothing is written to disk
    verify  milliseconds of one target verify call of N new tokens over a past of P cached tokens, median of repeats,
            and the ratio to N=1 (N=1 is the AR step). eager: TorchBackend.time_verify, the cost probes' call;
            captured: the --static-shapes round's device part at width N (verify, accept walk, commit and the one
            read-back; a CUDA graph per width on a GPU) over a cache of the target's context limit, as a run has it,
            with --no-compile; compiled: the same with the layers' parts around attention compiled by torch.compile
            (the default on CUDA). A row's first_ms is its first call's (a compiled mode's compile included)
    rounds  DominoTree rounds (frontier builder) of the real decode loop (dtrt.runtime.generate) after a prompt of P
            random tokens at each budget: milliseconds a round spends drafting, building, verifying and committing,
            as dtrt bench reports them (dtrt.bench.report.round_ms); then at T=1 (top-p 0.95) at the first prompt
            and budget, where the static rounds draw every row inside the round's graph. eager; captured and
            compiled: --static-shapes, with --cuda-graph's drafting graph on a GPU. Random weights accept nothing:
            these are costs, not speedups

The speedup those step times give at a stated tau (--tau, an input: the paper's per-category tau, named as such,
not measured here): tau x the AR step / a round at the first budget, 16 (its draft + build + verify + commit), per
model and mode.

Each section gets its share of --budget-s (what an earlier one leaves over carries on); a section out of time stops
where it is and is recorded as cut short; a mode whose call raises is recorded failed (the error's first line) and
skipped for the rest of the section, the other modes going on; --json is rewritten after every section.

    python benchmarks/gpu_shapes.py --device cuda --budget-s 400 --tau qwen3-4b=7.98 --json gpu-shapes.json
    python benchmarks/gpu_shapes.py --device cpu --tiny --json /tmp/dry.json        # the same paths at tiny shapes
"""

import argparse
import json
import signal
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from scale_check import CONFIGS, drafter_config, target_config

from dtrt.bench.report import round_ms, write_json
from dtrt.models.config import DrafterConfig, TargetConfig
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.target import Target
from dtrt.runtime.backends.torch import TorchBackend
from dtrt.runtime.generate import STAGES, Generation, generate
from dtrt.runtime.methods import make_method
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec
from dtrt.runtime.static_round import WIDTHS
from dtrt.tree import Tree

SHARES = {"build": 0.3, "verify": 0.35, "rounds": 0.35}
# the verify section's N and P and its (warm-up, timed) calls per shape; the rounds section's prompts and budgets
FULL = dict(ns=(1, 2, 4, 8, 16, 32, 64), pasts=(1024, 8192), prompts=(1024, 8192), budgets=(16, 32), reps=(3, 15))
TINY = dict(ns=(1, 2, 4, 8), pasts=(32, 64), prompts=(32,), budgets=(4, 8), reps=(1, 3))
ROUNDS = (2, 6)  # warm-up rounds, timed rounds per (prompt, budget)
TINY_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=2, num_target_layers=2, block_size=8)
TINY_DFLASH = dict(mask_token_id=511, target_layer_ids=[0, 1], gru_hidden_dim=16, emb_dim=24)
# Qwen/Qwen3-8B's config.json beside scale_check's Qwen3-4B (its embeddings are not tied)
SHAPES = {
    "qwen3-4b": (CONFIGS["qwen3-4b"], {}),
    "qwen3-8b": (
        {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "heads": 32, "kv": 8},
        {"tie_word_embeddings": False},
    ),
}
MODES = ("eager", "captured", "compiled")
STATIC = ("captured", "compiled")
PAPER_TAU = {"qwen3-4b": (7.98, "the paper's tau for Qwen3-4B DominoTree@16, an input")}


class Cut(BaseException):
    """A section ran out of its time (not an Exception: the code it interrupts must not catch it as a failure)."""


def failed(rows: list, row: dict, error: Exception) -> str:
    """A mode whose call raised: its row records the error in one line, and the section goes on without it (one
    mode's failure, a compile that breaks say, costs its own rows, not the others')."""
    why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    rows.append(row | {"error": why})
    print(f"gpu_shapes: {row} failed: {why}", flush=True)
    return why


def configs(*, tiny: bool, model: str = "qwen3-4b") -> tuple[dict, dict]:
    """The target's and the Domino drafter's config.json as released (tiny: the same keys at tiny sizes)."""
    c, extra = SHAPES[model]
    target, drafter = target_config(c) | extra, drafter_config(c, domino=True)
    if tiny:
        target |= TINY_TARGET
        drafter |= TINY_DRAFT
        drafter["dflash_config"] |= TINY_DFLASH
    return target, drafter


def parse(*, target: dict, drafter: dict) -> tuple[TargetConfig, DrafterConfig, tuple[int, int]]:
    """The configs through the loaders' parsers (the target's reads a file), and the head's (G, E)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(target))
        tcfg = TargetConfig.from_json(path)
    dflash = drafter["dflash_config"]
    return tcfg, DrafterConfig.from_dict(drafter, head=True), (dflash["gru_hidden_dim"], dflash["emb_dim"])


def random_init(module: torch.nn.Module, *, seed: int):
    """Norm weights 1, every matrix N(0, 0.02) (as trained checkpoints are near): activations stay finite in bf16."""
    gen = torch.Generator(next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


@contextmanager
def made_as(*, device: torch.device, dtype: torch.dtype):
    """Modules made inside are allocated on `device` in `dtype` (no full-precision copy on the host first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


def build(*, tiny: bool, device: torch.device, dtype: torch.dtype, model: str = "qwen3-4b"):
    """(mode -> a backend over the same modules, what was built)."""
    target_json, drafter_json = configs(tiny=tiny, model=model)
    tcfg, dcfg, (gru, emb) = parse(target=target_json, drafter=drafter_json)
    with made_as(device=device, dtype=dtype):
        target = Target(tcfg)
        drafter = Drafter(dcfg, DominoHead(dcfg.hidden_size, gru, emb, dcfg.vocab_size))
    random_init(target, seed=0)
    random_init(drafter, seed=1)
    backend = TorchBackend(target.eval(), drafter.eval(), device)
    # its cache sized as `dtrt run` sizes it: the target's context limit (40,960 positions for Qwen3)
    backends = {"eager": backend}
    for mode in STATIC:  # caches sized as `dtrt run` sizes them: the target's context limit
        backends[mode] = TorchBackend(target, drafter, device, max_context=target_json["max_position_embeddings"])
        backends[mode].prepare(RunSpec(static_shapes=True, compile=mode == "compiled"))
    backend.synchronize()
    params = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in drafter.parameters())
    return backends, {"target_params": params[0], "drafter_params": params[1]}


def static_call(backend, *, n: int, past: int):
    """One --static-shapes round's device part at width n over `past` cached entries, the cache put back after."""
    cache = backend.cache
    cache.past = past
    cache.length.fill_(past)
    backend.fused_round(Tree.chain([0] * (n - 1), root=0))
    cache.past = past


class Timer:
    """Milliseconds of a call: CUDA events around it on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def verify_section(backends: dict, rows: list, *, model: str, ns, pasts, reps, deadline: float):
    """backends: mode -> backend; each row names its model and mode (the static modes: the widths in WIDTHS only)."""
    for backend in backends.values():  # every call reads the cache's first `past` entries, whatever they hold
        backend.reset(max(pasts) + max(ns))
    timer, (warmup, repeats) = Timer(backends["eager"].device), reps
    broken = set()
    for past in pasts:
        for n in ns:
            for mode, backend in backends.items():
                if (mode in STATIC and n not in WIDTHS) or mode in broken:
                    continue
                if time.monotonic() > deadline:
                    raise Cut
                if mode == "eager":
                    call = lambda n=n, past=past, b=backend: b.time_verify(n, past)  # noqa: E731
                else:
                    call = lambda n=n, past=past, b=backend: static_call(b, n=n, past=past)  # noqa: E731
                row = {"model": model, "mode": mode, "past": past, "n": n}
                try:
                    first = timer(call)  # a compiled mode's first call of a width class compiles it
                    for _ in range(warmup - 1):
                        call()
                    times = [timer(call) for _ in range(repeats)]
                except Cut:
                    raise
                except Exception as e:  # noqa: BLE001 - any failure of one mode is recorded, the others go on
                    failed(rows, row, e)
                    broken.add(mode)
                    continue
                rows.append(row | {"first_ms": first, "ms": statistics.median(times), "min_ms": min(times)})
                one = next(
                    r["ms"] for r in rows if (r["model"], r["mode"], r["past"], r["n"]) == (model, mode, past, ns[0])
                )
                rows[-1]["over_n1"] = rows[-1]["ms"] / one


def round_spec(*, mode: str, budget: int, device: torch.device) -> RunSpec:
    graph = mode in STATIC and device.type == "cuda"  # drafting and building captured too
    return RunSpec(method="dominotree", budget=budget, builder="frontier", device=str(device), cuda_graph=graph,
                   static_shapes=mode in STATIC, compile=mode == "compiled")  # fmt: skip


SAMPLED = SamplingConfig(temperature=1.0, top_p=0.95)  # the rounds section's T>0 rows: every row drawn in the round


def rounds_section(backends: dict, rows: list, *, model: str, prompts, budgets, deadline: float, seed: int = 0):
    """T=0 rounds at every prompt and budget, then T=1 (top-p 0.95) at the first prompt and budget."""
    broken = set()
    cases = [(p, b, SamplingConfig()) for p in prompts for b in budgets] + [(prompts[0], budgets[0], SAMPLED)]
    for p, budget, sampling in cases:
        for mode, backend in backends.items():
            if mode in broken:
                continue
            vocab = backend.target.cfg.vocab_size
            prompt = torch.randint(0, vocab, (p,), generator=torch.Generator().manual_seed(seed)).tolist()
            method = make_method(round_spec(mode=mode, budget=budget, device=backend.device))
            row = {"model": model, "mode": mode, "builder": "frontier", "prompt": p, "budget": budget,
                   "temperature": sampling.temperature, "top_p": sampling.top_p, "rounds": 0}  # fmt: skip
            try:
                timed_rounds(backend, method, prompt, budget, row, rows, deadline, sampling)
            except Cut:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of one mode is recorded, the others go on
                rows.remove(row)
                failed(rows, row, e)
                broken.add(mode)


def timed_rounds(backend, method, prompt, budget, row, rows, deadline, sampling: SamplingConfig):
    """Warm-up rounds, then the timed ones, of one generation each; `row` (in `rows` from the start, so a cut
    generation keeps what it timed) gets the timed rounds' summary."""
    rows.append(row)
    for rounds, keep in zip(ROUNDS, (False, True)):
        gen = Generation()
        # room for every round to accept its whole tree: the count of rounds, not of tokens, ends it
        most = rounds * (budget + 1) + 1
        steps = generate(backend, method, prompt, most, sampling, budget=budget)
        try:
            for step in steps:
                if time.monotonic() > deadline:
                    row["cut"] = True
                    raise Cut
                gen.add(step)
                if len(gen.rounds) == rounds:
                    break
        finally:
            steps.close()
            if keep:  # what a cut generation timed is kept
                row.update(summary(gen))


def summary(gen: Generation) -> dict:
    stats = gen.stats()
    ms = round_ms([stats])
    if ms is None:
        return {}
    sizes = stats["tree_sizes"]
    return {
        "rounds": stats["rounds"],
        "tau": stats["tau"],
        "tree_size": sum(sizes) / len(sizes),
        "round_ms": ms,
        "total_ms": sum(ms.values()),
        "prefill_ms": 1e3 * stats["prefill_s"],
    }


class Budget:
    """Section limits out of one wall-clock budget, each enforced twice: the section checks its deadline between
    calls, and an alarm interrupts a call that runs past it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.left = dict(SHARES)

    def run(self, name: str, fn, record: dict):
        share = self.left.pop(name)
        limit = max(0.0, (self.end - time.monotonic()) * share / (share + sum(self.left.values())))
        record.update(status="running", limit_s=round(limit, 3))
        t0 = time.monotonic()
        try:
            if limit <= 0:
                raise Cut
            self._arm(limit)
            try:
                fn(deadline=t0 + limit)
            finally:
                self._arm(0)
            record["status"] = "done"
        except Cut:
            record["status"] = "cut short"
        record["wall_s"] = round(time.monotonic() - t0, 3)
        return record["status"] == "done"

    @staticmethod
    def _arm(seconds: float):
        def cut(*_):
            raise Cut

        if seconds > 0:
            signal.signal(signal.SIGALRM, cut)
            signal.setitimer(signal.ITIMER_REAL, seconds)
        else:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)


def speedups(report: dict, taus: dict, budget: int) -> list[dict]:
    """Per model and mode: tau x the AR step (verify N=1 at the first past) / a round at `budget` (the first
    prompt): its draft + build + verify + commit."""
    verify = [r for r in report["sections"].get("verify", {}).get("rows", []) if "ms" in r]
    rounds = [r for r in report["sections"].get("rounds", {}).get("rows", []) if "round_ms" in r]
    out = []
    for model, tau in taus.items():
        for mode in MODES:
            ar = [r for r in verify if (r["model"], r["mode"], r["n"]) == (model, mode, 1)]
            key = (model, mode, budget, 0.0)
            rnd = [r for r in rounds if (r["model"], r["mode"], r["budget"], r["temperature"]) == key]
            if ar and rnd:
                ar_ms, round_ms_ = ar[0]["ms"], rnd[0]["total_ms"]
                out.append(
                    {"model": model, "mode": mode, "tau": tau[0], "tau_is": tau[1], "budget": budget, "ar_ms": ar_ms,
                     "round_ms": round_ms_, "speedup": tau[0] * ar_ms / round_ms_}
                )  # fmt: skip
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"### Qwen3 shapes on the torch backend ({m['device']}, {m['dtype']}, torch {m['torch']})",
        "",
        "Random weights: what a round accepts means nothing (tau is shown as it came); these are costs, not speedups.",
        "eager: the plain torch backend; captured: --static-shapes --no-compile (a CUDA graph per verify width on a "
        "GPU, and --cuda-graph's drafting graph in the rounds); compiled: --static-shapes, the layers' parts around "
        "attention compiled by torch.compile.",
        "",
    ]
    if m["device"].startswith("cuda"):
        lines += [
            "A stage's clock stops when its host code returns, as in dtrt bench: device work still queued then is "
            "counted in the next stage that waits for it.",
            "",
        ]
    for name, sec in report["sections"].items():
        took = f", {sec['wall_s']:.1f} s of a {sec['limit_s']:.1f} s limit" if "wall_s" in sec else ""
        lines.append(f"- {name}: {sec['status']}{took}")
    verify = report["sections"].get("verify", {}).get("rows", [])
    if verify:
        ns = list(dict.fromkeys(r["n"] for r in verify))
        lines += ["", "ms of one target verify call of N new tokens over a past of P (ratio to N=1; N=1: the AR step)"]
        lines += ["", "| model | mode | P | " + " | ".join(f"N={n}" for n in ns) + " |", "|---" * (3 + len(ns)) + "|"]
        for key in dict.fromkeys((r["model"], r["past"], r["mode"]) for r in verify):
            cells = {r["n"]: f"{r['ms']:.2f} ({r['over_n1']:.2f}x)" if "ms" in r else "failed" for r in verify
                     if (r["model"], r["past"], r["mode"]) == key}  # fmt: skip
            model, past, mode = key
            lines.append(f"| {model} | {mode} | {past} | " + " | ".join(cells.get(n, "-") for n in ns) + " |")
    rounds = [r for r in report["sections"].get("rounds", {}).get("rows", []) if "round_ms" in r]
    if rounds:
        lines += ["", "DominoTree rounds: ms a round per stage (dtrt bench's round_ms), mean over the timed rounds", ""]
        lines += [
            f"| model | mode | T | prompt | budget | rounds | tau | nodes | {' | '.join(STAGES)} | total | prefill ms |"
        ]
        lines += ["|---" * (10 + len(STAGES)) + "|"]
        for r in rounds:
            stages = " | ".join(f"{r['round_ms'][k]:.2f}" for k in STAGES)
            lines.append(
                f"| {r['model']} | {r['mode']} | {r['temperature']:g} | {r['prompt']} | {r['budget']} | "
                f"{r['rounds']} | {r['tau']:.2f} | {r['tree_size']:.1f} | {stages} | {r['total_ms']:.2f} | "
                f"{r['prefill_ms']:.1f} |"
            )
    for section in ("verify", "rounds"):
        for r in report["sections"].get(section, {}).get("rows", []):
            if "error" in r:
                where = ", ".join(f"{k} {r[k]}" for k in ("past", "n", "prompt", "budget") if k in r)
                lines.append(f"\n- {r['model']}, {r['mode']} failed in {section} ({where}): {r['error']}; its later "
                             "calls were skipped")  # fmt: skip
    for r in report.get("speedups", []):
        lines.append(
            f"\n- {r['model']}, {r['mode']}: {r['speedup']:.2f}x at tau {r['tau']} ({r['tau_is']}): AR step "
            f"{r['ar_ms']:.2f} ms, a budget-{r['budget']} round {r['round_ms']:.2f} ms"
        )
    return "\n".join(lines) + "\n"


def taus_from(values: list[str], models: list[str]) -> dict:
    """model -> (tau, what it is): --tau MODEL=VALUE (or VALUE for every model); the paper's Qwen3-4B figure where
    none is given."""
    taus = {m: PAPER_TAU[m] for m in models if m in PAPER_TAU}
    for v in values:
        model, _, tau = v.rpartition("=")
        for m in [model] if model else models:
            if m not in models:
                raise SystemExit(f"error: --tau {v}: {m} is not among --models {','.join(models)}")
            taus[m] = (float(tau), "given with --tau, an input")
    return taus


def machine(device: torch.device, dtype: torch.dtype) -> dict:
    out = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    tau_help = "the tau the speedup is stated at (default: qwen3-4b=7.98, the paper's DominoTree@16)"
    ap.add_argument("--tau", action="append", default=[], metavar="[MODEL=]TAU", help=tau_help)
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds for all sections (after the imports)")
    ap.add_argument("--json", metavar="PATH", help="the report, rewritten after every section")
    args = ap.parse_args(argv)  # fmt: skip
    models_asked = [m for m in args.models.split(",") if m]
    if unknown := [m for m in models_asked if m not in SHAPES]:
        raise SystemExit(f"error: --models {','.join(unknown)}: use {', '.join(SHAPES)}")
    taus = taus_from(args.tau, models_asked)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"error: --device {args.device!r}: use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device}: torch {torch.__version__} sees no CUDA device")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:  # tiny shapes gain nothing from more threads, and wait on them when the machine is busy
        torch.set_num_threads(1)
    shapes = TINY if args.tiny else FULL
    budget = Budget(args.budget_s)
    report = {"args": vars(args), "machine": machine(device, dtype), "shapes": shapes, "sections": {}}
    secs = report["sections"]
    models = {}

    def save():
        report["speedups"] = speedups(report, taus, shapes["budgets"][0])
        if args.json:
            write_json(Path(args.json), report)

    def make(*, deadline):
        for m in models_asked:
            models[m], info = build(tiny=args.tiny, device=device, dtype=dtype, model=m)
            secs["build"].setdefault("models", {})[m] = info

    def verify(*, deadline):
        for m, backends in models.items():
            verify_section(backends, secs["verify"]["rows"], model=m, deadline=deadline,
                           **{k: shapes[k] for k in ("ns", "pasts", "reps")})  # fmt: skip

    def rounds(*, deadline):
        for m, backends in models.items():
            rounds_section(backends, secs["rounds"]["rows"], model=m, deadline=deadline,
                           prompts=shapes["prompts"], budgets=shapes["budgets"])  # fmt: skip

    for name, fn in (("build", make), ("verify", verify), ("rounds", rounds)):
        secs[name] = {"status": "running", **({"rows": []} if name != "build" else {})}
        save()  # a run killed in this section still leaves the earlier ones
        if name == "build" or models:
            budget.run(name, fn, secs[name])
        else:
            budget.left.pop(name)
            secs[name]["status"] = "skipped (the models were not built)"
        save()
    print(markdown(report))


if __name__ == "__main__":
    main()

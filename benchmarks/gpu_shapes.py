"""Costs at Qwen3-4B shapes on the torch backend, random weights, inside a wall-clock budget:

    build   the target (Qwen/Qwen3-4B's config) and the Domino-b16 drafter (5 layers, 5 taps, G 1024, E 256) parsed
            from their config.json as released and made on the device with random weights (bf16 on CUDA, fp32 on
            the CPU); nothing is written to disk
    verify  milliseconds of one target verify call (TorchBackend.time_verify, the cost probes' call) of N new tokens
            over a past of P cached tokens, median of repeats, and the ratio to N=1
    rounds  DominoTree rounds of the real decode loop (dtrt.runtime.generate) after a prompt of P random tokens at
            each budget: milliseconds a round spends drafting, building, verifying and committing, as dtrt bench
            reports them (dtrt.bench.report.round_ms). Random weights accept nothing: these are costs, not speedups

Each section gets its share of --budget-s (what an earlier one leaves over carries on); a section out of time stops
where it is and is recorded as cut short, and --json is rewritten after every section.

    python benchmarks/gpu_shapes.py --device cuda --json gpu-shapes.json
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

SHARES = {"build": 0.3, "verify": 0.35, "rounds": 0.35}
# the verify section's N and P and its (warm-up, timed) calls per shape; the rounds section's prompts and budgets
FULL = dict(ns=(1, 2, 4, 8, 16, 32, 64), pasts=(1024, 8192), prompts=(1024, 8192), budgets=(16, 32), reps=(3, 15))
TINY = dict(ns=(1, 2, 4, 8), pasts=(32, 64), prompts=(32,), budgets=(4, 8), reps=(1, 3))
ROUNDS = (2, 6)  # warm-up rounds, timed rounds per (prompt, budget)
TINY_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=2, num_target_layers=2, block_size=8)
TINY_DFLASH = dict(mask_token_id=511, target_layer_ids=[0, 1], gru_hidden_dim=16, emb_dim=24)


class Cut(Exception):
    """A section ran out of its time."""


def configs(*, tiny: bool) -> tuple[dict, dict]:
    """The target's and the Domino drafter's config.json as released (tiny: the same keys at tiny sizes)."""
    c = CONFIGS["qwen3-4b"]
    target, drafter = target_config(c), drafter_config(c, domino=True)
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


def build(*, tiny: bool, device: torch.device, dtype: torch.dtype):
    target_json, drafter_json = configs(tiny=tiny)
    tcfg, dcfg, (gru, emb) = parse(target=target_json, drafter=drafter_json)
    with made_as(device=device, dtype=dtype):
        target = Target(tcfg)
        drafter = Drafter(dcfg, DominoHead(dcfg.hidden_size, gru, emb, dcfg.vocab_size))
    random_init(target, seed=0)
    random_init(drafter, seed=1)
    backend = TorchBackend(target.eval(), drafter.eval(), device)
    backend.synchronize()
    params = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in drafter.parameters())
    return backend, {"target_params": params[0], "drafter_params": params[1]}


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


def verify_section(backend, rows: list, *, ns, pasts, reps, deadline: float):
    timer, (warmup, repeats) = Timer(backend.device), reps
    backend.reset(max(pasts) + max(ns))  # time_verify reads the cache's first `past` entries, whatever they hold
    for past in pasts:
        for n in ns:
            if time.monotonic() > deadline:
                raise Cut
            call = lambda n=n, past=past: backend.time_verify(n, past)  # noqa: E731
            for _ in range(warmup):
                call()
            times = [timer(call) for _ in range(repeats)]
            rows.append({"past": past, "n": n, "ms": statistics.median(times), "min_ms": min(times)})
            one = next(r["ms"] for r in rows if r["past"] == past and r["n"] == ns[0])
            rows[-1]["over_n1"] = rows[-1]["ms"] / one


def rounds_section(backend, rows: list, *, prompts, budgets, deadline: float, seed: int = 0):
    warm, timed = ROUNDS
    vocab = backend.target.cfg.vocab_size
    for p in prompts:
        prompt = torch.randint(0, vocab, (p,), generator=torch.Generator().manual_seed(seed)).tolist()
        for budget in budgets:
            method = make_method(RunSpec(method="dominotree", budget=budget, device=str(backend.device)))
            row = {"prompt": p, "budget": budget, "rounds": 0}
            rows.append(row)
            for rounds, keep in ((warm, False), (timed, True)):
                gen = Generation()
                # room for every round to accept its whole tree: the count of rounds, not of tokens, ends it
                most = rounds * (budget + 1) + 1
                steps = generate(backend, method, prompt, most, SamplingConfig(), budget=budget)
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


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"### Qwen3-4B shapes on the torch backend ({m['device']}, {m['dtype']}, torch {m['torch']})",
        "",
        "Random weights: what a round accepts means nothing (tau is shown as it came); these are costs, not speedups.",
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
        lines += ["", "ms of one target verify call of N new tokens over a past of P (ratio to N=1)", ""]
        lines += ["| P | " + " | ".join(f"N={n}" for n in ns) + " |", "|---" * (1 + len(ns)) + "|"]
        for past in dict.fromkeys(r["past"] for r in verify):
            cells = {r["n"]: f"{r['ms']:.2f} ({r['over_n1']:.2f}x)" for r in verify if r["past"] == past}
            lines.append(f"| {past} | " + " | ".join(cells.get(n, "cut") for n in ns) + " |")
    rounds = [r for r in report["sections"].get("rounds", {}).get("rows", []) if "round_ms" in r]
    if rounds:
        lines += ["", "DominoTree rounds: ms a round per stage (dtrt bench's round_ms), mean over the timed rounds", ""]
        lines += [f"| prompt | budget | rounds | tau | nodes | {' | '.join(STAGES)} | total | prefill ms |"]
        lines += ["|---" * (7 + len(STAGES)) + "|"]
        for r in rounds:
            stages = " | ".join(f"{r['round_ms'][k]:.2f}" for k in STAGES)
            lines.append(
                f"| {r['prompt']} | {r['budget']} | {r['rounds']} | {r['tau']:.2f} | {r['tree_size']:.1f} | "
                f"{stages} | {r['total_ms']:.2f} | {r['prefill_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def machine(device: torch.device, dtype: torch.dtype) -> dict:
    out = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="seconds for all sections (after the imports)")
    ap.add_argument("--json", metavar="PATH", help="the report, rewritten after every section")
    args = ap.parse_args(argv)
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
        if args.json:
            write_json(Path(args.json), report)

    def make(*, deadline):
        models["backend"], info = build(tiny=args.tiny, device=device, dtype=dtype)
        secs["build"].update(info)

    def verify(*, deadline):
        verify_section(models["backend"], secs["verify"]["rows"], deadline=deadline,
                       **{k: shapes[k] for k in ("ns", "pasts", "reps")})  # fmt: skip

    def rounds(*, deadline):
        rounds_section(models["backend"], secs["rounds"]["rows"], deadline=deadline,
                       prompts=shapes["prompts"], budgets=shapes["budgets"])  # fmt: skip

    for name, fn in (("build", make), ("verify", verify), ("rounds", rounds)):
        secs[name] = {"status": "running", **({"rows": []} if name != "build" else {})}
        save()  # a run killed in this section still leaves the earlier ones
        if name == "build" or "backend" in models:
            budget.run(name, fn, secs[name])
        else:
            budget.left.pop(name)
            secs[name]["status"] = "skipped (the models were not built)"
        save()
    print(markdown(report))


if __name__ == "__main__":
    main()

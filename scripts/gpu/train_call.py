"""The job's training call: from the shipped drafter, on every staged window and corpus row, featurized on the
GPU, as many steps as the call's time allows, with held-out tau and the best checkpoint written to the call's
return folder after every evaluation (a call cut short still brings the best one back).

Before the run, a short probe on a sample of the same rows measures what it decides: the step time of fp32
against bf16 autocast, of batch sizes, of the sampled loss against the full one; the target's featurizing rate; the
time of one held-out evaluation (which is also the tau of the drafter it starts from). The steps are then set so
that the cosine schedule ends when the time does."""

import copy
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import returned
import torch

PROBE_ROWS = 512
WARMUP, TIMED = 3, 8


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time_steps(target, start, data, cfg, device) -> float:
    """Seconds a step of `cfg` takes (the run's own train_step, from the drafter the run starts from)."""
    from dtrt.train import distributed
    from dtrt.train.trainer import SLOT_ACC_START, LossModel, train_step

    drafter = copy.deepcopy(start).to(device).train()
    model = LossModel(drafter, target)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.01)
    state = {"step": 0, "slot_acc": [SLOT_ACC_START] * drafter.cfg.k_draft}
    gen = torch.Generator().manual_seed(cfg.seed)
    ranks = distributed.from_env()
    for i in range(WARMUP + TIMED):
        if i == WARMUP:
            _sync(device)
            t0 = time.perf_counter()
        train_step(model, opt, data, cfg, gen, state, ranks=ranks, device=device)
        state["step"] += 1
    _sync(device)
    return (time.perf_counter() - t0) / TIMED


def choose(timings: dict, base_batch: int) -> dict:
    """The run's settings from the probe's step times: bf16 where it is faster; the batch past which rows/s gains
    less than a fifth (more steps beat bigger batches once the GPU is busy); the full loss where it costs at most a
    quarter more than the sampled one (it is exact)."""
    autocast = "bf16" if timings["precision"]["bf16"] <= timings["precision"]["fp32"] else "fp32"
    batches = sorted(timings["batch"])
    batch = batches[0]
    for b in batches[1:]:
        if b / timings["batch"][b] < 1.2 * batch / timings["batch"][batch]:
            break
        batch = b
    full = timings["candidates"].get(0)
    candidates = 0 if full is not None and full <= 1.25 * timings["candidates"]["sampled"] else None
    return {"autocast": autocast, "batch": batch or base_batch, "full_loss": candidates == 0}


# the run's steps against the probe's back-to-back ones: the run also draws its batches from all rows, logs and
# syncs for the progress bar (on an H200: 0.0334 s a step in the run, 0.0269 s in the probe)
RUN_VS_PROBE = 0.8


def plan_steps(train_s: float, *, step_s: float, eval_s: float, eval_every_s: float) -> int:
    """Steps that fill `train_s` seconds, an evaluation of `eval_s` after every `eval_every_s` seconds of steps:
    t + (t / every) * eval_s = train_s gives the seconds of steps t."""
    stepping = train_s * eval_every_s / (eval_every_s + eval_s) if eval_every_s > 0 else train_s
    return max(1, math.floor(RUN_VS_PROBE * stepping / step_s))


def probe(target, tokenizer, cfg, rows, start, eval_ids, device, *, batches, probe_rows, log) -> dict:
    from dtrt.train import store
    from dtrt.train.trainer import held_out_tau, taps_for

    tokens, lengths = rows
    n = min(probe_rows, tokens.shape[0])
    pick = torch.randperm(tokens.shape[0], generator=torch.Generator().manual_seed(0))[:n]
    _sync(device)
    t0 = time.perf_counter()
    data = store.in_memory(
        tokens[pick], lengths[pick], target, taps_for(target.cfg.num_layers), device, cfg.feature_batch
    )
    _sync(device)
    feat_rows_s = n / (time.perf_counter() - t0)
    log(f"probe: featurized {n} rows at {feat_rows_s:.0f} rows/s")
    timings = {"precision": {}, "batch": {}, "candidates": {}}
    mid = batches[len(batches) // 2]
    for autocast in ("fp32", "bf16"):
        timings["precision"][autocast] = _time_steps(
            target, start, data, replace(cfg, autocast=autocast, batch=mid), device
        )
    fast = "bf16" if timings["precision"]["bf16"] <= timings["precision"]["fp32"] else "fp32"
    for b in batches:
        timings["batch"][b] = (
            timings["precision"][fast]
            if b == mid
            else _time_steps(target, start, data, replace(cfg, autocast=fast, batch=b), device)
        )
    settings = choose(timings, cfg.batch)
    timings["candidates"]["sampled"] = timings["batch"][settings["batch"]]
    timings["candidates"][0] = _time_steps(
        target, start, data, replace(cfg, autocast=fast, batch=settings["batch"], candidates=0), device
    )
    settings = choose(timings, cfg.batch)
    for what, t in timings.items():
        log(f"probe: step seconds by {what}: " + ", ".join(f"{k}: {v:.4f}" for k, v in t.items()))
    drafter = copy.deepcopy(start).to(device)
    first = next(iter(eval_ids.values()))[:1]
    held_out_tau(target, drafter, tokenizer, {"warmup": first}, replace(cfg, eval_tokens=8))  # kernels compiled
    _sync(device)
    t0 = time.perf_counter()
    tau0 = held_out_tau(target, drafter, tokenizer, eval_ids, cfg)
    eval_s = time.perf_counter() - t0
    log(
        f"probe: held-out evaluation {eval_s:.1f}s; the drafter it starts from: {tau0['dominotree']:.2f} / "
        f"{tau0['dflash']:.2f}"
    )
    del data
    return {
        "feat_rows_s": feat_rows_s,
        "timings": {k: {str(a): b for a, b in v.items()} for k, v in timings.items()},
        "settings": settings,
        "eval_s": eval_s,
        "tau_start": tau0,
    }


def run(
    stage: Path,
    out: Path,
    work: Path,
    *,
    budget_s: float,
    device: str,
    piece_bytes: int | None,
    eval_every_s: float,
    probe_batches: list[int] | None = None,
    probe_rows: int = PROBE_ROWS,
    min_train_s: float = 0.0,
    log=print,
) -> dict:
    """The whole call; returns (and keeps writing) `out`/train.json; the best checkpoint goes to `out` in files of at
    most `piece_bytes` (None: one). `min_train_s`: the training after the probe gets at least this long and ten steps,
    the budget growing past `budget_s` when the probe ran slow (`budget_grown_s` in the report)."""
    from dtrt.bench.datasets import held_out_set
    from dtrt.models.checkpoint import load_target
    from dtrt.runtime.pipeline import stop_ids
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.train.config import TrainConfig
    from dtrt.train.trainer import build_rows, pick_mask_token, start_point, train_drafter

    began = time.perf_counter()
    spec = json.loads((stage / "run.json").read_text())
    target_path, out, work = work / "target", Path(out), Path(work)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    cfg = TrainConfig(**spec["config"], device=device, features="memory", init_from=str(stage / "drafter"))
    corpus, data_dirs = [stage / "corpus.txt"], [stage / d for d in spec["data"]]

    def save():
        report["elapsed_s"] = round(time.perf_counter() - began, 1)
        (out / "train.json.tmp").write_text(json.dumps(report, indent=1) + "\n")
        (out / "train.json.tmp").replace(out / "train.json")

    target = load_target(target_path).to(device).requires_grad_(False)
    tokenizer = load_tokenizer(target_path)
    held = dict(held_out_set(str(stage / f), target_path, True, cfg.eval_prompts) for f in spec["held_out"])
    eval_ids = {k: [tokenizer.encode(p, add_special_tokens=False) for p in v] for k, v in held.items()}
    start = start_point(Path(cfg.init_from), target, cfg, pick_mask_token(tokenizer, target.cfg.vocab_size))
    t0 = time.perf_counter()
    eos = stop_ids(target.cfg.eos_token_id, tokenizer, target_path)
    rows = build_rows(target, tokenizer, eos, cfg, corpus, [], lambda what: None, data_dirs, target_path)
    build_s = time.perf_counter() - t0
    report["rows"], report["build_rows_s"] = rows[0].shape[0], round(build_s, 1)
    report["padding_share"] = round(1 - rows[1].float().mean().item() / cfg.seq_len, 3)
    log(f"{rows[0].shape[0]} rows of {cfg.seq_len} tokens ({report['padding_share']:.1%} padding) in {build_s:.1f}s")
    report["probe"] = found = probe(
        target,
        tokenizer,
        cfg,
        rows,
        start,
        eval_ids,
        device,
        batches=probe_batches or spec["probe_batches"],
        probe_rows=probe_rows,
        log=log,
    )
    save()
    s = found["settings"]
    cfg = replace(cfg, autocast=s["autocast"], batch=s["batch"], candidates=0 if s["full_loss"] else cfg.candidates)
    step_s = found["timings"]["candidates"]["0" if s["full_loss"] else "sampled"]
    left = budget_s - (time.perf_counter() - began) - found["eval_s"] - 5  # the last evaluation and the export
    feat_s = rows[0].shape[0] / found["feat_rows_s"]
    train_s = left - build_s - feat_s
    floor = max(min_train_s, 10 * step_s) if min_train_s else 0.0
    if train_s < floor:
        report["budget_grown_s"] = round(floor - train_s, 1)
        left, train_s = left + floor - train_s, floor
    if train_s < 10 * step_s:
        raise SystemExit(f"train call: {left:.0f}s left after the probe: too little to train; give a larger --budget-s")
    steps = plan_steps(train_s, step_s=step_s, eval_s=found["eval_s"], eval_every_s=eval_every_s)
    cfg = replace(cfg, steps=steps, eval_every=steps, eval_every_s=eval_every_s, time_limit_s=left)
    report["plan"] = {"steps": steps, "seconds_left": round(left, 1), "featurize_s_expected": round(feat_s, 1)}
    report["config"], report["history"] = asdict(cfg), []
    log(f"training {steps} steps ({cfg.autocast}, batch {cfg.batch}, candidates {cfg.candidates}) in {left:.0f}s")
    save()

    def on_eval(record, best):
        report["history"].append({**record, "best": best, "call_s": round(time.perf_counter() - began, 1)})
        if best:
            report["returned"] = returned.export(
                work / "run" / "domino",
                out,
                piece_bytes=piece_bytes,
                extra={"step": record["step"], "tau": record["tau"]},
            )["step"]
        save()

    def run_log(line):
        if line.startswith("data:"):
            report.setdefault("data", []).append(line)
        log(line)

    state = train_drafter(
        target_path, work / "run", cfg, corpus, [], log=run_log, data_dirs=data_dirs, held_out=held, on_eval=on_eval
    )
    report["steps_done"], report["best"] = state["step"], state["best"]
    history = report["history"]
    if len(history) > 1:
        spent = history[-1]["elapsed_s"] - sum(h.get("eval_s", 0) for h in history)
        report["steps_per_s"] = round(state["step"] / max(spent, 1e-9), 2)
    save()
    return report

"""`dtrt train-drafter`: distil a DFlash drafter and a Domino head from a target, and save both in the released
layouts (`<out>/dflash`, `<out>/domino`; the Domino checkpoint is the same body plus the head).

Data (made once, stored under `<out>/.train/data/` by `dtrt.train.store`, its build resumable): corpus rows
teacher-forced through the target, windows of `dtrt drafter-data` rows and the target's own greedy continuations of
prompts; labels are always the target's greedy tokens. The drafter starts from the target's last layers and final
norm, or from a trained drafter of the same shape (`init_from`). The loss scores a sampled share of the vocabulary
(`distill.Candidates`) unless `candidates` is 0. Held-out tau (DominoTree on the torch backend, held-out prompts) is
measured every `eval_every` steps and the best checkpoint is kept. `<out>/.train/state.pt`, written every
`save_every` steps and on an interrupt, makes a run resumable, and the resumed run takes the same steps as an
uninterrupted one. Under torchrun the steps are data-parallel (`dtrt.train.distributed`)."""

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import check_pair, drafter_state, load_drafter, load_target, save_checkpoint
from dtrt.models.config import DrafterConfig, default_target_layer_ids
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.hybrid import HybridTarget
from dtrt.models.target import Target
from dtrt.runtime.tokenizer import load_tokenizer
from dtrt.train import distributed, store
from dtrt.train.config import TrainConfig
from dtrt.train.data import continuations, read_corpus, text_rows, windows
from dtrt.train.datagen import check_data, load_rows
from dtrt.train.distill import block_loss, draw_candidates, needed_ids, sample_anchors, slot_weights, tau_weights

# the running per-depth accuracy (what --slot-weighting tau weighs by): a mean over about 1 / (1 - SLOT_EMA) steps,
# starting where a drafter that has learnt little stands rather than at zero (which would leave the later depths
# untrained at the start)
SLOT_EMA = 0.99
SLOT_ACC_START = 0.5


def taps_for(num_layers: int) -> list[int]:
    """Five evenly spread target layers (z-lab's formula); every layer after the first for shallow targets."""
    return default_target_layer_ids(num_layers, 5) if num_layers >= 8 else list(range(1, num_layers))


def drafter_config_json(target: Target, cfg: TrainConfig, mask_token_id: int, domino: bool) -> dict:
    t = target.cfg
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "tie_word_embeddings": True,
        "block_size": cfg.block_size,
        "num_target_layers": t.num_layers,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps_for(t.num_layers)},
    }
    if domino:  # same body and row convention as the DFlash checkpoint, plus the head
        out["dflash_config"].update(
            projector_type="domino",
            gru_hidden_dim=cfg.gru_dim,
            emb_dim=cfg.emb_dim,
            pure_draft_prefix_len=1,
            shift_label=False,
        )
    return out


def new_drafter(target: Target, cfg: TrainConfig, mask_token_id: int) -> Drafter:
    dcfg = DrafterConfig.from_dict(drafter_config_json(target, cfg, mask_token_id, True))
    drafter = Drafter(dcfg, DominoHead(dcfg.hidden_size, cfg.gru_dim, cfg.emb_dim, dcfg.vocab_size))
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    for p in drafter.head.prefix_gru.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.nn.init.zeros_(drafter.head.embed_proj[2].weight)  # the head starts as no correction
    for d_layer, t_layer in zip(drafter.layers, target.model.layers[-cfg.layers :]):
        d_layer.load_state_dict(
            {k: v for k, v in t_layer.state_dict().items() if k in d_layer.state_dict()}, strict=False
        )
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    return drafter


def start_point(path: Path, target: Target, cfg: TrainConfig, mask_token_id: int) -> Drafter:
    """The trained Domino checkpoint at `path` (--init-from), checked to be of the run's shape: the same flags,
    target taps and mask token as the drafter the run would make."""
    flag = f"--init-from {path}"
    src = load_drafter(path)  # a missing or broken checkpoint is the loader's one-line error, naming the file
    check_pair(target, src, flag)
    if src.head is None:
        raise DtrtError(f"{flag}: a DFlash checkpoint (no Domino head); give the run's domino/ beside it")
    mine, theirs = DrafterConfig.from_dict(drafter_config_json(target, cfg, mask_token_id, True)), src.cfg
    for name, a, b in (
        ("--layers", mine.num_layers, theirs.num_layers),
        ("--block-size", mine.block_size, theirs.block_size),
        ("--gru-dim", cfg.gru_dim, src.head.gru_dim),
        ("--emb-dim", cfg.emb_dim, src.head.emb_dim),
    ):
        if a != b:
            raise DtrtError(f"{flag}: it was trained with {name} {b}, this run has {a}; pass {name} {b}")
    for what in ("target_layer_ids", "mask_token_id", "intermediate_size", "shift_label"):
        if (a := getattr(mine, what)) != (b := getattr(theirs, what)):
            raise DtrtError(f"{flag}: its {what} is {b}, where a drafter dtrt trains for this target has {a}")
    return src


def pick_mask_token(tokenizer, vocab: int) -> int:
    """An embedding row no text maps to (Qwen3's drafters use an unused row); else the last special token."""
    used = len(tokenizer)
    return vocab - 1 if used < vocab else max(tokenizer.all_special_ids or [vocab - 1])


def build_rows(
    target: Target,
    tokenizer,
    eos: tuple[int, ...],
    cfg: TrainConfig,
    corpus,
    prompts: list[str],
    progress,
    data=(),
    target_path=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S, T], valid lengths [S]): corpus rows, windows of `dtrt drafter-data` rows (a seeded subset of
    --data-rows from each directory) and the target's continuations of the training prompts (each ending at one
    of `eos`)."""
    T = cfg.seq_len
    rows = [text_rows(tokenizer, read_corpus(corpus, cfg.corpus_chars), T, cfg.corpus_rows)] if corpus else []
    lengths = [torch.full((rows[0].shape[0],), T)] if rows else []
    for d in data:
        shard_rows = load_rows(d, target_path)[0]
        tokens, valid = windows([r.tokens for r in shard_rows], [r.response_start for r in shard_rows], T)
        if tokens.shape[0] > cfg.data_rows:
            keep = torch.randperm(tokens.shape[0], generator=torch.Generator().manual_seed(cfg.seed))[: cfg.data_rows]
            tokens, valid = tokens[keep], valid[keep]
        rows.append(tokens)
        lengths.append(valid)
    if prompts:
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        gen, gen_lengths = continuations(
            target,
            ids,
            cfg.gen_tokens,
            T,
            eos,
            cfg.gen_batch,
            log=progress("continuations"),
        )
        rows.append(gen)
        lengths.append(gen_lengths)
    if not rows:
        raise DtrtError("no training data: give --data DIR, --corpus PATH and/or --prompts FILE")
    return torch.cat(rows), torch.cat(lengths)


@torch.no_grad()
def held_out_tau(
    target: Target, drafter: Drafter, tokenizer, sets: dict[str, list], cfg: TrainConfig, vocab=None
) -> dict:
    """Tau of DominoTree and of the DFlash chain on each held-out set of prompts (torch backend, T=0): per set
    (`sets`: name -> method -> mean over its prompts) and the mean of the sets (method -> tau), which picks the
    best checkpoint. `vocab`: the draft vocabulary (dtrt.models.draft_vocab; None: the whole one)."""
    from dtrt.runtime.backends.torch import TorchBackend
    from dtrt.runtime.generate import collect, generate
    from dtrt.runtime.methods import make_method
    from dtrt.runtime.sampling import SamplingConfig
    from dtrt.runtime.spec import RunSpec

    drafter.eval()
    backend = TorchBackend(target, drafter, draft_vocab=vocab)
    per_set = {}
    for set_name, prompts in sets.items():
        per_set[set_name] = {}
        for name in ("dominotree", "dflash"):
            spec = RunSpec(method=name)
            method = make_method(spec)
            taus = [
                collect(generate(backend, method, p, cfg.eval_tokens, SamplingConfig(), budget=spec.budget)).tau
                for p in prompts
            ]
            per_set[set_name][name] = sum(taus) / len(taus)
    drafter.train()
    out = {name: sum(t[name] for t in per_set.values()) / len(per_set) for name in ("dominotree", "dflash")}
    return {**out, "sets": per_set}


def save_drafters(drafter: Drafter, target: Target, cfg: TrainConfig, out: Path):
    """<out>/dflash (body) and <out>/domino (body + head), replaced atomically."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.save_dtype]
    state = {k: v.to(dtype) for k, v in drafter_state(drafter).items()}
    mask = drafter.cfg.mask_token_id
    for kind in ("dflash", "domino"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out))
        body = {k: v for k, v in state.items() if kind == "domino" or not k.startswith(("prefix_gru", "embed_proj"))}
        save_checkpoint(tmp, drafter_config_json(target, cfg, mask, kind == "domino"), body)
        if (out / kind).exists():
            shutil.rmtree(out / kind)
        os.replace(tmp, out / kind)


class LossModel(torch.nn.Module):
    """The drafter's training loss as a module, so DistributedDataParallel can wrap it; the frozen target is kept
    out of its parameters (nothing of it is broadcast or reduced)."""

    def __init__(self, drafter: Drafter, target: Target):
        super().__init__()
        self.drafter = drafter
        object.__setattr__(self, "target", target)

    def forward(self, tokens, feats, anchors, slot_decay, labels, lengths, **kw):
        return block_loss(self.target, self.drafter, tokens, feats, anchors, slot_decay, labels, lengths, **kw)


def prepare_data(target, target_path, tokenizer, cfg, corpus, prompts, data_dirs, work: Path, progress, log):
    """Build (or finish building) the run's data store; with --features memory, the data itself, on the device."""
    from dtrt.runtime.pipeline import stop_ids

    def rows():
        eos = stop_ids(target.cfg.eos_token_id, tokenizer, target_path)
        return build_rows(target, tokenizer, eos, cfg, corpus, prompts, progress, data_dirs, target_path)

    path = work / "data"
    if cfg.features == "memory":
        t0 = time.perf_counter()
        tokens, lengths = rows()
        t1 = time.perf_counter()
        device = next(target.parameters()).device
        taps = taps_for(target.cfg.num_layers)
        data = store.in_memory(tokens, lengths, target, taps, device, cfg.feature_batch, log=progress("features"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log(
            f"data: {tokens.shape[0]} rows x {cfg.seq_len} tokens laid out in {t1 - t0:.0f}s, labelled and "
            f"featurized on {device} in {time.perf_counter() - t1:.1f}s"
        )
        return data
    if (work / "data.pt").is_file():
        raise DtrtError(f"{work / 'data.pt'}: data of an older dtrt; delete it and --resume rebuilds the data")
    if not store.started(path):
        t0 = time.perf_counter()
        tokens, lengths = rows()
        store.create(path, tokens, lengths, len(taps_for(target.cfg.num_layers)) * target.cfg.hidden_size)
        log(f"data: {tokens.shape[0]} rows x {cfg.seq_len} tokens laid out in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    done = store.fill(
        path, target, taps_for(target.cfg.num_layers), cfg.device, cfg.feature_batch, log=progress("features")
    )
    log(f"data: {done['rows']} rows labelled and featurized ({time.perf_counter() - t0:.0f}s this run) in {path}")
    return None


def train_drafter(
    target_path: Path,
    out: Path,
    cfg: TrainConfig,
    corpus=(),
    prompts: list[str] = (),
    resume: bool = False,
    log=print,
    progress=None,
    data_dirs=(),
    held_out: dict[str, list[str]] | None = None,
    on_eval=None,
) -> dict | None:
    """Train, evaluate and save; returns the run's state (None on ranks other than 0). `held_out`: name -> prompts
    (as the target reads them) of each set that held-out tau is measured on. `on_eval(record, best)`: called after
    each evaluation, once the drafters are saved when it was the best."""
    ranks = distributed.from_env()
    device = distributed.device_for(cfg.device, ranks)
    out = Path(out)
    work = out / ".train"
    if ranks.main and out.exists() and not resume and any(out.iterdir()):
        raise DtrtError(f"--out {out}: already holds a run; pass --resume to continue it or choose another --out")
    for d in data_dirs:  # before anything is written: data of this target, where it says
        check_data(d, target_path)
    distributed.shard(cfg.batch, ranks)  # refuses a batch the ranks cannot share
    distributed.start(ranks, device)
    try:
        run = (target_path, out, work, cfg, ranks, device, corpus, prompts, held_out, resume, log, progress)
        state = _train(*run, data_dirs, on_eval)
    except BaseException:
        distributed.stop(ranks, finished=False)
        raise
    distributed.stop(ranks)
    return state


def _train(
    target_path, out, work, cfg, ranks, device, corpus, prompts, held_out, resume, log, progress, data_dirs, on_eval
) -> dict:
    started = time.perf_counter()
    target = load_target(target_path).to(device).requires_grad_(False)
    if isinstance(target, HybridTarget):  # the draft layers start from the target's, and data rows are left-padded
        raise DtrtError(
            f"{target_path}: dtrt train-drafter trains drafters for dense targets (Qwen3, Llama); "
            "hybrid Gated-DeltaNet targets are not supported yet"
        )
    torch.manual_seed(cfg.seed)
    progress = (progress or (lambda what: None)) if ranks.main else (lambda what: None)
    log = log if ranks.main else (lambda *a: None)
    tokenizer = load_tokenizer(target_path)
    prompts = list(prompts)
    held_out = {name: list(texts)[: cfg.eval_prompts] for name, texts in (held_out or {}).items()}
    if not held_out and len(prompts) > cfg.eval_prompts:
        held_out, prompts = {"prompts": prompts[-cfg.eval_prompts :]}, prompts[: -cfg.eval_prompts]
    mask_token_id = pick_mask_token(tokenizer, target.cfg.vocab_size)
    resuming = resume and (work / "state.pt").is_file()
    # checked before the data, which can take hours to build; a resumed run's weights are in its state
    source = start_point(Path(cfg.init_from), target, cfg, mask_token_id) if cfg.init_from and not resuming else None
    if cfg.features == "memory" and ranks.world > 1:
        raise DtrtError("--features memory: one process only; under torchrun use --features disk")
    data = None
    if ranks.main:
        work.mkdir(parents=True, exist_ok=True)
        (work / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        data = prepare_data(target, target_path, tokenizer, cfg, corpus, prompts, data_dirs, work, progress, log)
    distributed.barrier(ranks)
    data = data or store.load(work / "data")
    if held_out:
        eval_ids = {name: [tokenizer.encode(p, add_special_tokens=False) for p in ps] for name, ps in held_out.items()}
    else:  # hold out the last rows' first halves as prompts, and train on the rest
        n = min(cfg.eval_prompts, max(1, len(data) // 10))
        eval_ids = {"data": [r[: cfg.seq_len // 2].tolist() for r in data.tokens[-n:]]}
        data = data.split(n)

    drafter = new_drafter(target, cfg, mask_token_id)
    if source is not None:
        drafter.load_state_dict(source.state_dict())
    drafter = drafter.to(device)
    model = distributed.wrap(LossModel(drafter, target), ranks, device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    K = drafter.cfg.k_draft
    state = {"step": 0, "best": None, "history": [], "slot_acc": [SLOT_ACC_START] * K}
    if resuming:
        saved = torch.load(work / "state.pt", weights_only=False, map_location=device)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"].cpu())
        state = {"slot_acc": [SLOT_ACC_START] * K, **saved["state"]}  # runs saved before slot_acc existed
        log(f"resumed at step {state['step']} (best held-out tau {state['best']})")

    def checkpoint():
        if not ranks.main:
            return
        torch.save(
            {
                "drafter": drafter.state_dict(),
                "optimizer": opt.state_dict(),
                "generator": gen.get_state(),
                "state": state,
            },
            work / "state.pt.tmp",
        )
        os.replace(work / "state.pt.tmp", work / "state.pt")

    bar = progress("train")
    t0 = last_eval = time.perf_counter()
    try:
        while state["step"] < cfg.steps:
            step = state["step"]
            loss, acc = train_step(model, opt, data, cfg, gen, state, ranks=ranks, device=device)
            state["step"] = step = step + 1
            if bar:
                bar(step, cfg.steps, f"loss {loss.item():.3f} acc@1 {acc[0]:.2f}")
            now = time.perf_counter()
            timed_out = cfg.time_limit_s > 0 and now - started >= cfg.time_limit_s
            due = cfg.eval_every_s > 0 and now - last_eval >= cfg.eval_every_s
            if step % cfg.eval_every == 0 or step == cfg.steps or due or timed_out:
                if ranks.main:
                    evaluate(target, drafter, tokenizer, eval_ids, cfg, state, loss, acc, t0, work, out, log, on_eval)
                checkpoint()
                distributed.barrier(ranks)
                last_eval = time.perf_counter()
            elif step % cfg.save_every == 0:
                checkpoint()
            if timed_out:
                log(f"stopped at step {step} of {cfg.steps}: --time-limit {cfg.time_limit_s:g}s reached")
                break
    except KeyboardInterrupt:
        checkpoint()
        raise DtrtError(f"interrupted at step {state['step']}: --resume continues from it") from None
    return state if ranks.main else None  # the other ranks never evaluate


def train_step(model, opt, data, cfg: TrainConfig, gen, state: dict, *, ranks, device):
    """One optimizer step at `state["step"]` on a batch drawn by `gen` (the running per-depth accuracy updated);
    returns (loss, per-depth accuracy). `model`: the LossModel, or its DistributedDataParallel wrapper."""
    inner = getattr(model, "module", model)
    drafter, T, V = inner.drafter, cfg.seq_len, inner.target.cfg.vocab_size
    K, mine, step = drafter.cfg.k_draft, distributed.shard(cfg.batch, ranks), state["step"]
    bf16 = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")
    lr = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
    for g in opt.param_groups:
        g["lr"] = lr
    idx = torch.randint(0, len(data), (cfg.batch,), generator=gen)
    lengths = data.lengths[idx]
    anchors = sample_anchors(lengths, cfg.anchors, gen)
    candidates = None
    if cfg.candidates:  # from the whole global batch, so every rank scores the same entries
        labels = torch.from_numpy(data.labels[idx.numpy()].astype("int64"))
        topk = torch.from_numpy(data.topk[idx.numpy()].astype("int64"))
        candidates = draw_candidates(needed_ids(labels, topk, anchors, K), V, cfg.candidates, gen)
    depth = tau_weights(state["slot_acc"]) if cfg.slot_weighting == "tau" else None
    normalizer = slot_weights(anchors, lengths, K, T, cfg.slot_decay, depth).sum() / ranks.world
    batch = data.rows(idx[mine], device)
    with bf16:
        loss, acc = model(
            batch["tokens"],
            batch["feats"],
            anchors[mine].to(device),
            cfg.slot_decay,
            batch["labels"],
            batch["lengths"],
            candidates=candidates,
            normalizer=normalizer.to(device),
            depth_weights=depth,
        )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    mean = distributed.mean(acc.detach().float(), ranks).cpu()  # every rank's, so the ranks weigh alike
    state["slot_acc"] = [SLOT_EMA * s + (1 - SLOT_EMA) * float(a) for s, a in zip(state["slot_acc"], mean)]
    return loss, acc


def evaluate(target, drafter, tokenizer, eval_ids, cfg, state, loss, acc, t0, work, out, log, on_eval=None):
    """Held-out tau now; the drafters are saved when it is the best so far."""
    began = time.perf_counter()
    tau = held_out_tau(target, drafter, tokenizer, eval_ids, cfg)
    record = {
        "step": state["step"],
        "loss": loss.item(),
        "acc": [round(a, 3) for a in acc.tolist()[:4]],
        "slot_acc": [round(a, 3) for a in state["slot_acc"]],  # the running per-depth accuracy
        "tau": tau,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "eval_s": round(time.perf_counter() - began, 1),
    }
    state["history"].append(record)
    with open(work / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    best = state["best"] is None or tau["dominotree"] > state["best"]
    if best:
        state["best"] = tau["dominotree"]
        save_drafters(drafter, target, cfg, out)
    if on_eval:
        on_eval(record, best)
    sets = "".join(
        f"; {name} {t['dominotree']:.2f} / {t['dflash']:.2f}" for name, t in tau["sets"].items() if len(tau["sets"]) > 1
    )
    log(
        f"step {state['step']}: held-out tau dominotree {tau['dominotree']:.2f} dflash {tau['dflash']:.2f}{sets} "
        f"(best {state['best']:.2f})"
    )

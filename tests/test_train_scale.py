"""`dtrt train-drafter` at scale, on the tiny pair: the sampled loss against the full-vocabulary loss, the data
store on disk (an interrupted build resumes to the same arrays), an interrupted run resumed to the same state as an
uninterrupted one, and data-parallel training (DDP over gloo) against one process."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import load_drafter, load_target
from dtrt.train import distributed, store
from dtrt.train.config import TrainConfig
from dtrt.train.distill import block_loss, draw_candidates, needed_ids, sample_anchors, slot_weights, tau_weights
from dtrt.train.trainer import LossModel, train_drafter
from dtrt.zoo import tiny as tiny_mod

pytestmark = pytest.mark.usefixtures("one_thread")

T = 48


@pytest.fixture(scope="module")
def case(tiny):
    """The tiny target and Domino drafter, a batch of corpus rows with the target's labels, top-k and features."""
    target = load_target(tiny.target).requires_grad_(False)
    drafter = load_drafter(tiny.domino)
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.train.data import text_rows

    tokens = text_rows(load_tokenizer(tiny.target), tiny_mod.corpus(4000, 11), T, 6)
    taps = drafter.cfg.target_layer_ids
    with torch.no_grad():
        logits, feats = target(
            tokens, torch.arange(T).expand_as(tokens), torch.ones(T, T, dtype=torch.bool).tril(), taps=taps
        )
    top = logits.topk(store.TOPK, -1).indices
    labels = torch.cat((tokens[:, :1], top[:, :-1, 0]), 1)
    topk = torch.cat((tokens[:, :1, None].expand(-1, -1, store.TOPK), top[:, :-1]), 1)
    anchors = sample_anchors(torch.full((tokens.shape[0],), T), 3, torch.Generator().manual_seed(1))
    return target, drafter, tokens, feats, labels, topk, anchors


def loss_and_grads(case, **kw):
    target, drafter, tokens, feats, labels, topk, anchors = case
    drafter.zero_grad(set_to_none=True)
    loss, acc = block_loss(target, drafter, tokens, feats, anchors, 4.0, labels, **kw)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_candidates_cover_the_labels_and_the_target_top_k(case):
    _, drafter, _, _, labels, topk, anchors = case
    K = drafter.cfg.k_draft
    need = needed_ids(labels, topk, anchors, K)
    pos = (anchors[..., None] + 1 + torch.arange(K)).clamp(max=T - 1)
    for r in range(labels.shape[0]):
        for p in pos[r].flatten().tolist():
            assert set(topk[r, p].tolist()) | {labels[r, p].item()} <= set(need.tolist())
    c = draw_candidates(need, 128, need.numel() + 10, torch.Generator().manual_seed(0))
    assert c.ids.numel() == need.numel() + 10 and c.ids.unique().numel() == c.ids.numel()
    assert c.ids[: need.numel()].tolist() == need.tolist() and (c.log_weight[: need.numel()] == 0).all()
    assert torch.allclose(c.log_weight[need.numel() :], torch.tensor(math.log((128 - need.numel()) / 10)))
    full = draw_candidates(need, 128, 128, torch.Generator())
    assert full.ids.tolist() == list(range(128)) and (full.log_weight == 0).all()


def test_sampled_loss_over_the_whole_vocabulary_is_the_full_loss(case):
    full, g_full = loss_and_grads(case)
    every = draw_candidates(torch.tensor([0]), 128, 128, torch.Generator())
    sampled, g_sampled = loss_and_grads(case, candidates=every)
    assert sampled == pytest.approx(full, rel=1e-6)
    assert g_full.keys() == g_sampled.keys()
    for n in g_full:
        assert torch.allclose(g_full[n], g_sampled[n], atol=1e-6, rtol=1e-5), n


def test_sampled_loss_estimates_the_full_loss(case):
    """With a quarter of the free vocabulary drawn, the loss and its gradient average to the full ones."""
    _, drafter, _, _, labels, topk, anchors = case
    full, g_full = loss_and_grads(case)
    need = needed_ids(labels, topk, anchors, drafter.cfg.k_draft)
    size = need.numel() + (128 - need.numel()) // 4
    gen = torch.Generator().manual_seed(0)
    losses, grads = [], {n: torch.zeros_like(g) for n, g in g_full.items()}
    for _ in range(60):
        loss, g = loss_and_grads(case, candidates=draw_candidates(need, 128, size, gen))
        losses.append(loss)
        for n in grads:
            grads[n] += g[n] / 60
    assert np.mean(losses) == pytest.approx(full, rel=0.02)
    flat = torch.cat([grads[n].flatten() for n in g_full])
    ref = torch.cat([g_full[n].flatten() for n in g_full])
    assert torch.nn.functional.cosine_similarity(flat, ref, dim=0) > 0.98
    # one draw alone is a noisier but still aligned step, and it differs from the full loss (the set is partial)
    one, g_one = loss_and_grads(case, candidates=draw_candidates(need, 128, size, gen))
    assert one != full
    assert torch.nn.functional.cosine_similarity(torch.cat([g_one[n].flatten() for n in g_full]), ref, dim=0) > 0.8


def filled_store(case, path, batch):
    """The case's rows built into a store at `path` in chunks of `batch`; returns (lengths, taps)."""
    target, drafter, tokens, feats, *_ = case
    lengths, taps = torch.full((tokens.shape[0],), T), drafter.cfg.target_layer_ids
    store.create(path, tokens, lengths, feats.shape[-1])
    store.fill(path, target, taps, "cpu", batch=batch)
    return lengths, taps


def test_the_store_resumes_an_interrupted_build(tiny, case, tmp_path):
    target, drafter, tokens, feats, labels, topk, _ = case
    lengths, taps = filled_store(case, tmp_path / "a", 2)

    def stop_after_first(done, total):
        if done >= 2:
            raise KeyboardInterrupt

    store.create(tmp_path / "b", tokens, lengths, feats.shape[-1])
    with pytest.raises(KeyboardInterrupt):
        store.fill(tmp_path / "b", target, taps, "cpu", batch=2, log=stop_after_first)
    with pytest.raises(DtrtError, match="2 of 6 rows built"):
        store.load(tmp_path / "b")
    assert store.fill(tmp_path / "b", target, taps, "cpu", batch=2)["done"] == 6
    a, b = store.load(tmp_path / "a"), store.load(tmp_path / "b")
    for name in ("labels", "topk", "feats"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.labels, labels.numpy()) and np.array_equal(a.topk, topk.numpy())
    assert np.allclose(a.feats, feats.to(torch.float16).numpy())
    rows = a.rows(torch.tensor([4, 1]), "cpu")
    assert rows["tokens"].tolist() == tokens[[4, 1]].tolist() and rows["feats"].dtype == torch.float16


def test_data_built_in_memory_is_the_stores(tiny, case, tmp_path):
    """--features memory: the same labels, top-k and features as the disk store, batches served from the device."""
    target, _, tokens, *_ = case
    lengths, taps = filled_store(case, tmp_path / "a", 4)
    disk, mem = store.load(tmp_path / "a"), store.in_memory(tokens, lengths, target, taps, "cpu", batch=4)
    assert isinstance(mem.feats, torch.Tensor)
    assert np.array_equal(disk.labels, mem.labels) and np.array_equal(disk.topk, mem.topk)
    assert np.array_equal(disk.feats, mem.feats.numpy())
    a, b = disk.rows(torch.tensor([5, 0, 2]), "cpu"), mem.rows(torch.tensor([5, 0, 2]), "cpu")
    assert all(torch.equal(a[k], b[k]) for k in a)


SMALL = TrainConfig(
    seq_len=64,
    block_size=6,
    gru_dim=16,
    emb_dim=16,
    batch=4,
    anchors=4,
    lr=3e-3,
    eval_prompts=2,
    eval_tokens=12,
    corpus_rows=24,
    steps=8,
    eval_every=8,
    save_every=2,
    candidates=48,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    (d / "corpus.txt").write_text(tiny_mod.corpus(20000, 7))
    return d / "corpus.txt"


def drafter_tensors(run: Path) -> dict:
    return torch.load(run / ".train" / "state.pt", weights_only=False)["drafter"]


def test_tau_weights_are_the_gradient_of_a_chains_tau():
    """--slot-weighting tau weighs depth k by d tau / d a_k, tau = 1 + sum_d prod_{j<=d} a_j (finite differences)."""

    def tau(a):
        return 1 + sum(math.prod(a[: d + 1]) for d in range(len(a)))

    acc = [0.8, 0.6, 0.5, 0.3, 0.7, 0.2, 0.4]
    eps = 1e-6
    want = [(tau(acc[:k] + [acc[k] + eps] + acc[k + 1 :]) - tau(acc)) / eps for k in range(len(acc))]
    assert torch.allclose(tau_weights(acc), torch.tensor(want), rtol=1e-4)
    assert tau_weights([1.0] * 3).tolist() == [3.0, 2.0, 1.0]  # every depth reached: what each opens after it
    assert tau_weights([0.0] * 3).tolist() == [1.0, 0.0, 0.0]  # nothing accepted: only the first depth counts
    anchors = torch.tensor([[0, 13]])
    w = slot_weights(anchors, torch.tensor([16]), 3, 16, 4.0, tau_weights([0.5, 0.5, 0.5]))
    assert w.tolist() == [[[1.75, 0.75, 0.25], [1.75, 0.75, 0.0]]]  # and no label past the row's end


@pytest.mark.parametrize("weighting", ["decay", "tau"])
def test_an_interrupted_run_resumes_to_the_same_state(tiny, corpus, tmp_path, weighting):
    cfg = TrainConfig(**{**SMALL.__dict__, "slot_weighting": weighting})
    straight = tmp_path / "straight"
    state = train_drafter(tiny.target, straight, cfg, corpus=[corpus], log=lambda *a: None)

    def interrupt_at_5(what):
        def bar(step, total, text=""):
            if what == "train" and step == 5:
                raise KeyboardInterrupt

        return bar

    run = tmp_path / "run"
    with pytest.raises(DtrtError, match="interrupted at step 5: --resume"):
        train_drafter(tiny.target, run, cfg, corpus=[corpus], log=lambda *a: None, progress=interrupt_at_5)
    assert torch.load(run / ".train" / "state.pt", weights_only=False)["state"]["step"] == 5
    resumed = train_drafter(tiny.target, run, cfg, corpus=[corpus], resume=True, log=lambda *a: None)
    assert resumed["step"] == 8 and resumed["slot_acc"] == state["slot_acc"] != [0.5] * len(state["slot_acc"])
    a, b = drafter_tensors(straight), drafter_tensors(run)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_a_run_starts_from_a_trained_drafter(tiny, corpus, tmp_path):
    """--init-from: the new run's drafter is the checkpoint's (lr 0 keeps it), a fresh run's is not; a checkpoint
    of another shape is refused in one line before any data is built."""
    first = tmp_path / "first"
    train_drafter(tiny.target, first, SMALL, corpus=[corpus], log=lambda *a: None)
    trained = load_drafter(first / "domino").state_dict()
    still = TrainConfig(**{**SMALL.__dict__, "steps": 1, "eval_every": 1, "lr": 0.0})
    runs = {}
    for name, init in (("fresh", None), ("init", str(first / "domino"))):
        cfg = TrainConfig(**{**still.__dict__, "init_from": init})
        train_drafter(tiny.target, tmp_path / name, cfg, corpus=[corpus], log=lambda *a: None)
        runs[name] = drafter_tensors(tmp_path / name)
    assert all(torch.equal(runs["init"][n], trained[n]) for n in trained)
    assert not all(torch.equal(runs["fresh"][n], trained[n]) for n in trained)
    # a resumed run reads its own state, not the checkpoint it started from
    (first / "domino").rename(first / "moved")
    cfg = TrainConfig(**{**still.__dict__, "steps": 2, "eval_every": 2, "init_from": str(first / "domino")})
    assert train_drafter(tiny.target, tmp_path / "init", cfg, corpus=[corpus], resume=True, log=lambda *a: None)
    (first / "moved").rename(first / "domino")

    bad = [
        ({"gru_dim": 8}, "it was trained with --gru-dim 16, this run has 8; pass --gru-dim 16"),
        ({"block_size": 4}, "--block-size 6"),
        ({"init_from": str(first / "dflash")}, "a DFlash checkpoint"),
        ({"init_from": str(tmp_path / "none")}, "none/config.json: not found"),
    ]
    for change, message in bad:
        cfg = TrainConfig(**{**SMALL.__dict__, "init_from": str(first / "domino"), **change})
        with pytest.raises(DtrtError, match=message):
            train_drafter(tiny.target, tmp_path / "bad", cfg, corpus=[corpus], log=lambda *a: None)
        assert not (tmp_path / "bad" / ".train" / "data").exists()


def test_a_time_limited_in_memory_bf16_run(tiny, corpus, tmp_path):
    """The GPU run's settings on the CPU: features in memory (no store on disk), bf16 autocast, evaluations by the
    clock, a time limit that stops the run early with an evaluation and a saved best checkpoint, each evaluation
    reported to on_eval."""
    cfg = TrainConfig(
        **{
            **SMALL.__dict__,
            **dict(features="memory", autocast="bf16", steps=10_000, eval_every=10_000),
            **dict(time_limit_s=3.0, eval_every_s=0.5),
        }
    )
    seen = []
    state = train_drafter(
        tiny.target, tmp_path / "run", cfg, corpus=[corpus], log=lambda *a: None, on_eval=lambda r, b: seen.append(b)
    )
    assert 0 < state["step"] < cfg.steps
    assert len(seen) == len(state["history"]) >= 2 and seen[0] is True
    assert state["history"][-1]["step"] == state["step"]  # the last step is evaluated
    assert not (tmp_path / "run" / ".train" / "data").exists()
    assert load_drafter(tmp_path / "run" / "domino").head is not None


def test_the_ranks_share_a_batch():
    assert [distributed.shard(10, distributed.Ranks(r, 4)) for r in range(4)] == [
        slice(0, 3),
        slice(3, 6),
        slice(6, 8),
        slice(8, 10),
    ]
    with pytest.raises(DtrtError, match="--batch 2: smaller than the 4 processes"):
        distributed.shard(2, distributed.Ranks(0, 4))
    assert distributed.from_env({}) == distributed.Ranks(0, 1, 0)
    with pytest.raises(DtrtError, match="RANK 9 is not in WORLD_SIZE 8"):
        distributed.from_env({"WORLD_SIZE": "8", "RANK": "9"})
    assert distributed.device_for("cuda", distributed.Ranks(3, 4, 1)) == "cuda:1"
    assert distributed.device_for("cpu", distributed.Ranks(3, 4, 1)) == "cpu"


def _ddp_rank(rank: int, world: int, port: int, tiny_target: str, tiny_domino: str, batch: dict, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    ranks = distributed.from_env()
    distributed.start(ranks, "cpu")
    target = load_target(tiny_target).requires_grad_(False)
    drafter = load_drafter(tiny_domino)
    model = distributed.wrap(LossModel(drafter, target), ranks, "cpu")
    mine = distributed.shard(batch["tokens"].shape[0], ranks)
    loss, _ = model(
        batch["tokens"][mine],
        batch["feats"][mine],
        batch["anchors"][mine],
        4.0,
        batch["labels"][mine],
        None,
        normalizer=batch["normalizer"] / world,
    )
    loss.backward()
    if ranks.main:
        torch.save({n: p.grad for n, p in drafter.named_parameters()}, out)
    distributed.stop(ranks)


def test_data_parallel_gradients_equal_one_process(tiny, case):
    """Two gloo ranks, each on its half of the batch under DDP, give the one-process gradient of the whole batch."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    target, drafter, tokens, feats, labels, _, anchors = case
    normalizer = slot_weights(anchors, None, drafter.cfg.k_draft, T, 4.0).sum()
    _, g_one = loss_and_grads(case)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    batch = {"tokens": tokens, "feats": feats, "anchors": anchors, "labels": labels, "normalizer": normalizer}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "grads.pt")
        mp.spawn(_ddp_rank, args=(2, port, str(tiny.target), str(tiny.domino), batch, out), nprocs=2)
        g_ddp = torch.load(out)
    for n, g in g_one.items():
        assert torch.allclose(g, g_ddp[n], atol=1e-6, rtol=1e-4), n
    # a rank's half alone is not the whole batch's gradient: the test can tell the shares apart
    half, _ = block_loss(target, drafter, tokens[:3], feats[:3], anchors[:3], 4.0, labels[:3], normalizer=normalizer)
    drafter.zero_grad(set_to_none=True)
    half.backward()
    assert not torch.allclose(drafter.head.w2.grad, g_one["head.embed_proj.2.weight"], atol=1e-6)


@pytest.mark.slow
def test_torchrun_trains_and_saves(tiny, corpus, tmp_path):
    """`torchrun --nproc_per_node 2 -m dtrt.cli train-drafter` on the CPU: one run directory, both drafters saved."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "dtrt.cli",
        "train-drafter",
        "--model",
        "tiny",
        "--out",
        str(out),
        "--corpus",
        str(corpus),
        *("--seq-len 64 --block-size 6 --gru-dim 16 --emb-dim 16 --batch 4 --anchors 4 --eval-prompts 2".split()),
        *("--eval-tokens 12 --corpus-rows 16 --steps 4 --eval-every 4 --candidates 48".split()),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "best held-out tau" in res.stdout
    log = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4]  # one rank evaluated and logged
    assert load_drafter(out / "domino").head is not None and load_drafter(out / "dflash").head is None


def test_held_out_prompts_are_what_tau_is_measured_on(tiny, corpus, tmp_path, monkeypatch):
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.train import trainer

    seen = []

    def held_out_tau(target, drafter, tokenizer, sets, cfg):
        seen.append(sets)
        return {"dominotree": 1.0, "dflash": 1.0, "sets": {name: {"dominotree": 1.0, "dflash": 1.0} for name in sets}}

    monkeypatch.setattr(trainer, "held_out_tau", held_out_tau)
    held_out = {"a": ["The moon is very ", "One happy child ", "A small bird "], "b": ["The dog "]}
    cfg = TrainConfig(**{**SMALL.__dict__, "steps": 2, "eval_every": 2, "eval_prompts": 2})
    train_drafter(tiny.target, tmp_path / "run", cfg, corpus=[corpus], held_out=held_out, log=lambda *a: None)
    tok = load_tokenizer(tiny.target)
    ids = {name: [tok.encode(p, add_special_tokens=False) for p in texts[:2]] for name, texts in held_out.items()}
    assert seen == [ids]


@pytest.mark.gpu
def test_cuda_training_step_matches_the_cpu_step(tiny, case):
    """The sampled loss and its gradient on a CUDA device equal the CPU's on the same batch and candidates."""
    target, drafter, tokens, feats, labels, topk, anchors = case
    need = needed_ids(labels, topk, anchors, drafter.cfg.k_draft)
    cands = draw_candidates(need, 128, need.numel() + 20, torch.Generator().manual_seed(3))
    cpu, g_cpu = loss_and_grads(case, candidates=cands)
    gpu_case = (
        target.to("cuda"),
        drafter.to("cuda"),
        tokens.cuda(),
        feats.cuda(),
        labels.cuda(),
        topk.cuda(),
        anchors.cuda(),
    )
    try:
        gpu, g_gpu = loss_and_grads(gpu_case, candidates=cands)
    finally:
        target.to("cpu"), drafter.to("cpu")
    assert gpu == pytest.approx(cpu, rel=1e-4)
    for n, g in g_cpu.items():
        assert torch.allclose(g, g_gpu[n].cpu(), atol=1e-5, rtol=1e-3), n


@pytest.mark.gpu
def test_train_drafter_on_cuda(tiny, corpus, tmp_path):
    cfg = TrainConfig(**{**SMALL.__dict__, "device": "cuda"})
    state = train_drafter(tiny.target, tmp_path / "run", cfg, corpus=[corpus], log=lambda *a: None)
    assert state["step"] == SMALL.steps and state["best"] >= 1
    assert load_drafter(tmp_path / "run" / "domino").head is not None

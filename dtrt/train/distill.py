"""Drafter training by distillation from the target: the target's tapped features of a token sequence are the
context, blocks are anchored at random positions, and the labels are the sequence's next tokens (the target's
own greedy continuation, so the drafter learns what the verifier will accept). Trains the DFlash body and,
when the drafter has one, the Domino head along the label path (teacher forcing), in one loss."""

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dtrt.models.drafter import Drafter
from dtrt.models.target import Target


@dataclass
class DistillConfig:
    steps: int = 300
    batch: int = 16  # sequences per step
    anchors: int = 4  # blocks per sequence
    lr: float = 3e-3
    slot_decay: float = 4.0  # loss weight of draft depth d: exp(-d / slot_decay)
    seed: int = 0


def block_loss(
    target: Target, drafter: Drafter, tokens, feats, anchors, slot_decay: float = 4.0, labels=None, lengths=None
):
    """tokens [b, T], feats [b, T, taps*H] (target taps), anchors [b, A] block start positions; labels [b, T]
    the target's greedy token for each position (default: the tokens themselves, i.e. the target's own text);
    lengths [b] the valid prefix of each row. Returns (loss, per-depth argmax accuracy [K] of the final scores)."""
    cfg = drafter.cfg
    b, T = tokens.shape
    A, B, K = anchors.shape[1], cfg.block_size, cfg.k_draft
    embed = target.model.embed_tokens
    ctx_kv = drafter.context_kv(feats.to(drafter.dtype), torch.arange(T, device=tokens.device).expand(b, T))

    ids = torch.full((b, A, B), cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    ids[..., 0] = tokens.gather(1, anchors)
    x = embed(ids).reshape(b, A * B, -1).to(drafter.dtype)
    positions = (anchors[..., None] + torch.arange(B, device=tokens.device)).reshape(b, A * B)
    sees_ctx = (torch.arange(T, device=tokens.device) < anchors[..., None]).repeat_interleave(B, dim=1)  # [b, A*B, T]
    sees_blk = torch.block_diag(*[torch.ones(B, B, dtype=torch.bool, device=tokens.device)] * A).expand(b, -1, -1)
    hidden = drafter.block(x, positions, ctx_kv, torch.cat((sees_ctx, sees_blk), dim=-1))
    rows = drafter.proposal_rows(hidden.reshape(b, A, B, -1))  # [b, A, K, H]

    label_pos = anchors[..., None] + 1 + torch.arange(K, device=tokens.device)  # [b, A, K]
    valid = label_pos < (T if lengths is None else lengths[:, None, None])
    labels = (tokens if labels is None else labels).gather(1, label_pos.clamp(max=T - 1).reshape(b, -1))
    labels = labels.reshape(b, A, K)
    weight = torch.exp(-torch.arange(K, dtype=torch.float32, device=tokens.device) / slot_decay) * valid
    W = target.lm_head.weight
    scores = F.linear(rows.reshape(-1, W.shape[1]).to(W.dtype), W).float().reshape(b, A, K, -1)  # one GEMM
    loss = (F.cross_entropy(scores.flatten(0, 2), labels.flatten(), reduction="none") * weight.flatten()).sum()

    head = drafter.head
    if head is not None:  # path states along the labels, then every depth's correction in one call
        states, s = [], head.gru(embed(ids[..., 0]).to(head.w2.dtype), head.zero_state(b, A))
        for d in range(K):
            states.append(s)
            s = head.gru(embed(labels[:, :, d]).to(head.w2.dtype), s)
        delta = (
            head.delta(rows.to(head.w2.dtype).reshape(b * A * K, -1), torch.stack(states, dim=2).reshape(b * A * K, -1))
            .float()
            .reshape(b, A, K, -1)
        )
        corrects = (torch.arange(K, device=tokens.device) >= cfg.pure_draft_prefix_len)[:, None]
        scores = scores + delta * corrects
        loss = (
            loss + (F.cross_entropy(scores.flatten(0, 2), labels.flatten(), reduction="none") * weight.flatten()).sum()
        )
    acc = ((scores.argmax(-1) == labels) & valid).float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)
    return loss / weight.sum(), acc


def sample_anchors(lengths, A: int, gen):
    """[b, A] anchor positions with at least one context token before and one label after."""
    hi = (lengths - 1).clamp(min=2)
    u = torch.rand(lengths.shape[0], A, generator=gen)
    return (1 + u * (hi - 1)[:, None]).long()


def distill(target: Target, drafter: Drafter, tokens, feats, cfg: DistillConfig, log=None):
    """Train `drafter` in place on tokens [S, T] with their target features [S, T, taps*H]."""
    gen = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, tokens.shape[0], (cfg.batch,), generator=gen)
        anchors = sample_anchors(lengths[idx], cfg.anchors, gen)
        loss, acc = block_loss(target, drafter, tokens[idx], feats[idx], anchors, cfg.slot_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if log and (step % 50 == 0 or step == cfg.steps - 1):
            log(
                f"step {step:4d}  loss {loss.item():.3f}  acc@1 {acc[0]:.2f}  acc@2 {acc[min(1, len(acc) - 1)]:.2f}"
                f"  {time.perf_counter() - t0:.0f}s"
            )
    return drafter

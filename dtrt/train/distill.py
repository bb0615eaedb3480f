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


@dataclass
class Candidates:
    """The vocabulary entries a sampled loss scores: every label of the batch and the target's top-k at it (needed),
    then uniform negatives from the rest, each standing for rest / drawn entries (its log weight), so that the
    softmax's normalizer is estimated without bias and the full-vocabulary product is never run."""

    ids: torch.Tensor  # Long [C], the needed ids first
    log_weight: torch.Tensor  # [C]: 0 for needed ids, log(rest / drawn) for the negatives


def label_positions(anchors, K: int):
    """[b, A, K]: the positions whose labels a block anchored at `anchors` [b, A] drafts."""
    return anchors[..., None] + 1 + torch.arange(K, device=anchors.device)


def needed_ids(labels, topk, anchors, K: int):
    """Long [n]: the distinct labels and target top-k ids at the positions the blocks draft."""
    pos = label_positions(anchors, K).clamp(max=labels.shape[1] - 1).flatten(1)  # [b, A*K]
    ids = [labels.gather(1, pos).flatten()]
    if topk is not None:
        ids.append(topk.gather(1, pos[..., None].expand(-1, -1, topk.shape[-1])).flatten())
    return torch.unique(torch.cat(ids))


def draw_candidates(needed, vocab: int, size: int, gen) -> Candidates:
    """`size` entries: the needed ids and uniform negatives drawn (by `gen`) from the rest; the whole vocabulary,
    unweighted, once `size` reaches it."""
    needed = needed.cpu()
    if size >= vocab:
        return Candidates(torch.arange(vocab), torch.zeros(vocab))
    free = torch.ones(vocab, dtype=torch.bool)
    free[needed] = False
    perm = torch.randperm(vocab, generator=gen)
    drawn = perm[free[perm]][: max(0, size - needed.numel())]
    rest = vocab - needed.numel()
    weight = torch.full((drawn.numel(),), math.log(rest / max(1, drawn.numel())))
    return Candidates(torch.cat((needed, drawn)), torch.cat((torch.zeros(needed.numel()), weight)))


def slot_weights(anchors, lengths, K: int, T: int, slot_decay: float, depth=None):
    """[b, A, K]: the loss weight of every drafted slot where a label exists: exp(-d / slot_decay) at depth d, or
    `depth` [K] (tau_weights) when given."""
    valid = label_positions(anchors, K) < (T if lengths is None else lengths[:, None, None])
    if depth is None:
        return torch.exp(-torch.arange(K, dtype=torch.float32, device=anchors.device) / slot_decay) * valid
    return depth.to(device=anchors.device, dtype=torch.float32) * valid


def tau_weights(acc) -> torch.Tensor:
    """[K]: each drafted slot weighted by what it adds to a chain's tau. With per-slot acceptance a_1..a_K, tau =
    1 + sum_d prod_{j<=d} a_j, so d tau / d a_k = prod_{j<k} a_j * (1 + sum_{d>k} prod_{k<j<=d} a_j): how often slot
    k is reached, times what its acceptance opens after it. exp(-d / slot_decay) is a fixed guess at the same."""
    a = torch.as_tensor(acc, dtype=torch.float32).clamp(0.0, 1.0)
    reach = torch.cumprod(torch.cat((a.new_ones(1), a[:-1])), 0)
    after = torch.ones_like(a)
    for k in range(len(a) - 2, -1, -1):
        after[k] = 1 + a[k + 1] * after[k + 1]
    return reach * after


def block_loss(
    target: Target,
    drafter: Drafter,
    tokens,
    feats,
    anchors,
    slot_decay: float = 4.0,
    labels=None,
    lengths=None,
    *,
    candidates: Candidates | None = None,
    normalizer=None,
    depth_weights=None,
):
    """tokens [b, T], feats [b, T, taps*H] (target taps), anchors [b, A] block start positions; labels [b, T]
    the target's greedy token for each position (default: the tokens themselves, i.e. the target's own text);
    lengths [b] the valid prefix of each row. `candidates`: score only these vocabulary entries (default: all).
    `normalizer`: what the weighted sum is divided by (default: its own total weight; data-parallel ranks pass the
    global batch's share). `depth_weights` [K]: the slots' weights in place of exp(-d / slot_decay). Returns (loss,
    per-depth argmax accuracy [K] of the final scores, among the scored entries)."""
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

    label_pos = label_positions(anchors, K)
    labels = (tokens if labels is None else labels).gather(1, label_pos.clamp(max=T - 1).reshape(b, -1))
    labels = labels.reshape(b, A, K)
    weight = slot_weights(anchors, lengths, K, T, slot_decay, depth_weights)
    valid = weight > 0
    W = target.lm_head.weight
    columns, bias, targets = None, 0.0, labels.flatten()
    if candidates is not None:
        columns = candidates.ids.to(tokens.device)
        bias = candidates.log_weight.to(tokens.device)
        where = torch.full((W.shape[0],), -1, dtype=torch.long, device=tokens.device)
        where[columns] = torch.arange(columns.numel(), device=tokens.device)
        targets = where[targets]
        assert bool((targets >= 0).all()), "every label must be a needed candidate"
        W = W[columns]
    scores = F.linear(rows.reshape(-1, W.shape[1]).to(W.dtype), W).float().reshape(b, A, K, -1)  # one GEMM
    loss = (F.cross_entropy((scores + bias).flatten(0, 2), targets, reduction="none") * weight.flatten()).sum()

    head = drafter.head
    if head is not None:  # path states along the labels, then every depth's correction in one call
        states, s = [], head.gru(embed(ids[..., 0]).to(head.w2.dtype), head.zero_state(b, A))
        for d in range(K):
            states.append(s)
            s = head.gru(embed(labels[:, :, d]).to(head.w2.dtype), s)
        delta = (
            head.delta(
                rows.to(head.w2.dtype).reshape(b * A * K, -1),
                torch.stack(states, dim=2).reshape(b * A * K, -1),
                columns,
            )
            .float()
            .reshape(b, A, K, -1)
        )
        corrects = (torch.arange(K, device=tokens.device) >= cfg.pure_draft_prefix_len)[:, None]
        scores = scores + delta * corrects
        loss = (
            loss + (F.cross_entropy((scores + bias).flatten(0, 2), targets, reduction="none") * weight.flatten()).sum()
        )
    hits = (scores.argmax(-1) == targets.reshape(b, A, K)) & valid
    acc = hits.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)
    return loss / (weight.sum() if normalizer is None else normalizer), acc


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

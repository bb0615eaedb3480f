"""The one decode loop: draft -> build -> verify -> accept -> commit, for every method and backend."""

import time
from dataclasses import dataclass, field

import torch

from dtrt.runtime.methods import Method
from dtrt.runtime.sampling import SamplingConfig, choose
from dtrt.tree import Tree, accept


@dataclass
class RoundStats:
    accepted: int  # accepted draft nodes + 1 (the bonus token): this round's tau
    tree_size: int  # verify width, root included
    draft_s: float
    build_s: float
    verify_s: float
    commit_s: float


@dataclass
class Generation:
    tokens: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = "length"  # "eos" | "length" | whatever on_tokens returned ("stop", "cancelled")

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (accepted drafts + bonus)."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over decode time (the clock starts after prefill)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0


def capacity_for(prompt_len: int, max_new_tokens: int, budget: int, block_size: int) -> int:
    return prompt_len + max_new_tokens + max(budget, block_size) + 2


@torch.no_grad()
def generate(
    backend,
    method: Method,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos: tuple[int, ...] = (),
    budget: int = 16,
    on_tokens=None,
) -> Generation:
    """Generate up to `max_new_tokens` tokens after `prompt`; `on_tokens(list)` streams committed tokens and may
    return a reason (e.g. "stop", "cancelled") to end the generation after this round with that stop_reason."""
    drafter = backend.drafter if method.uses_drafter else None
    block = drafter.cfg.block_size if drafter is not None else 1
    backend.reset(capacity_for(len(prompt), max_new_tokens, budget, block))
    # samples are drawn where the logits are (a CUDA torch backend keeps them on the device)
    gen = torch.Generator(getattr(backend, "device", "cpu")).manual_seed(sampling.seed)
    out = Generation(tokens=[])

    t0 = time.perf_counter()
    n = len(prompt)
    logits, hidden = backend.target_forward(
        torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    )
    backend.commit(torch.arange(n))
    root = int(choose(logits[-1:], sampling, gen)[0])
    if drafter is not None:
        backend.draft_context(hidden, torch.arange(n))
        method.prepare(backend, drafter.cfg.k_draft)
    out.prefill_s = time.perf_counter() - t0

    def emit(tokens):
        for i, t in enumerate(tokens):
            if t in eos:
                out.stop_reason = "eos"
                return tokens[: i + 1]
        return tokens

    new = emit([root])[:max_new_tokens]
    out.tokens += new
    if on_tokens and (reason := on_tokens(new)):
        out.stop_reason = reason
    t_start = time.perf_counter()
    while len(out.tokens) < max_new_tokens and out.stop_reason == "length":
        t0 = time.perf_counter()
        start = backend.past
        if drafter is not None:
            tree, t1 = method.draft(backend, root, start)
        else:
            t1 = time.perf_counter()
            tree = Tree.chain([], root=root)
        t2 = time.perf_counter()
        logits, hidden = backend.target_forward(tree.tokens, tree.positions(start), tree.mask)
        accepted, bonus = accept(tree, choose(logits, sampling, gen))
        t3 = time.perf_counter()
        backend.commit(accepted)
        if drafter is not None:
            idx = torch.tensor(accepted)
            backend.draft_context(hidden[idx], start + torch.arange(len(accepted)))
        t4 = time.perf_counter()
        out.rounds.append(RoundStats(len(accepted), len(tree), t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        new = emit(tree.tokens[accepted[1:]].tolist() + [bonus])[: max_new_tokens - len(out.tokens)]
        out.tokens += new
        if on_tokens and (reason := on_tokens(new)):
            out.stop_reason = reason
        root = bonus
    out.decode_s = time.perf_counter() - t_start
    return out

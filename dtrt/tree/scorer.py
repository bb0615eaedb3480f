"""Per-round child scoring, shared by the heap and frontier builders.

A scorer answers three questions, batched over requests (bs) and nodes (n):
    root_states()                -> [bs, G]           path state of each root ([bs, 1] dummy when state-free)
    children(states, depth)      -> tokens, logprobs  Long/float32 [bs, n, k], top-k sorted descending
    advance(states, tokens)      -> [bs, n, G]        state of each child
`depth` is the 0-based draft depth of the children: row `depth` of the drafter block predicts them.
A scorer may say `reads_state(depth)` is False where children() ignores the states: the heap builder then computes no
state for it (dtrt.tree.heap).
Builders also read `round`, `batch`, `depth` (D, the number of draft depths) and `k` from a scorer.
The builders import no model: Domino's scorers live in dtrt.scoring, the exported ones in the backends.
"""

from dataclasses import dataclass
from typing import Protocol

import torch


class Scorer(Protocol):
    """What the builders call (the shape of Domino-Tree's children function)."""

    round: "Round"
    batch: int
    depth: int
    k: int

    def root_states(self) -> torch.Tensor: ...

    def children(self, states: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Round:
    ph: torch.Tensor  # [bs, D, H] drafter hidden rows; row d predicts the token at draft depth d
    base: torch.Tensor  # [bs, D, V] float32 base logits, the target lm_head of ph
    root: torch.Tensor  # Long[bs] the committed token each tree hangs from

    @property
    def batch(self) -> int:
        return self.base.shape[0]

    @property
    def depth(self) -> int:
        return self.base.shape[1]

    @property
    def vocab(self) -> int:
        return self.base.shape[2]

    def select(self, b: int) -> "Round":
        """Request b alone, as a batch-1 round."""
        return Round(self.ph[b : b + 1], self.base[b : b + 1], self.root[b : b + 1])


class TableScorer:
    """Children that do not depend on the node: one top-k table per depth, shared by every node."""

    def __init__(self, round: Round, tokens: torch.Tensor, logprobs: torch.Tensor):
        self.round = round
        self.tokens, self.logprobs = tokens, logprobs  # [bs, D, k]
        self.batch, self.depth, self.k = tokens.shape

    def reads_state(self, depth: int) -> bool:
        return False

    def root_states(self) -> torch.Tensor:
        return torch.zeros(self.batch, 1, device=self.tokens.device)

    def children(self, states: torch.Tensor, depth: int):
        shape = (self.batch, states.shape[1], self.k)
        return self.tokens[:, depth, None].expand(shape), self.logprobs[:, depth, None].expand(shape)

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return states


def marginal_topk(base: torch.Tensor, k: int):
    lp, tok = torch.topk(torch.log_softmax(base.float(), dim=-1), k, dim=-1)
    return tok, lp


class MarginalScorer(TableScorer):
    """The `marg` arm (and DFlash/DDTree drafts): top-k of the base marginal at each depth."""

    @torch.no_grad()
    def __init__(self, round: Round, k: int):
        super().__init__(round, *marginal_topk(round.base, min(k, round.vocab)))

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
from functools import cached_property
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
    """One round's drafter output. The base logits cover the draft vocabulary's columns (dtrt.models.draft_vocab):
    `logits` [bs, D, V'] with `ids` the target id of each column, or the whole vocabulary (`ids` None, V' = V). The
    marginal builders read the columns (a top-k over V', ids mapped back); `base`, the full [bs, D, V] row with -inf
    outside the subset, is made only for a consumer that indexes the whole vocabulary (Domino's scorer, the exported
    scorer, chain and frontier stages)."""

    ph: torch.Tensor  # [bs, D, H] drafter hidden rows; row d predicts the token at draft depth d
    logits: torch.Tensor  # [bs, D, V'] float32 base logits, the target lm_head of ph over the draft vocabulary
    root: torch.Tensor  # Long[bs] the committed token each tree hangs from
    ids: torch.Tensor | None = None  # Long[V'] ascending target ids of the columns (None: every id, V' = V)
    vocab_size: int | None = None  # V, where `ids` is given

    def __post_init__(self):
        if self.ids is not None and self.vocab_size is None:
            raise ValueError("a round over a draft vocabulary needs the target's vocab_size")

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    @property
    def depth(self) -> int:
        return self.logits.shape[1]

    @property
    def vocab(self) -> int:
        """V, the target's vocabulary."""
        return self.logits.shape[2] if self.ids is None else self.vocab_size

    @cached_property
    def base(self) -> torch.Tensor:
        """[bs, D, V] float32 base logits over the whole vocabulary, -inf outside the draft vocabulary."""
        if self.ids is None:
            return self.logits
        full = self.logits.new_full((*self.logits.shape[:2], self.vocab_size), float("-inf"))
        return full.index_copy_(2, self.ids, self.logits)

    def marginal_topk(self, k: int, depths: int | None = None, topk=torch.topk) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-`k` tokens (target ids) and log-probs of the base marginal at the first `depths` depths (all by
        default), [bs, depths, k] each: a top-k over the draft vocabulary's columns, whose order is the ids' order,
        so the tokens are those of the full row's top-k (`topk`: torch.topk's signature, see dtrt.tree.topk)."""
        logits = self.logits if depths is None else self.logits[:, :depths]
        tok, lp = marginal_topk(logits, min(k, logits.shape[-1]), topk)
        return (tok if self.ids is None else self.ids[tok]), lp

    def prefix(self, depths: int) -> "Round":
        """The round's first `depths` depths."""
        return Round(self.ph[:, :depths], self.logits[:, :depths], self.root, self.ids, self.vocab_size)

    def select(self, b: int) -> "Round":
        """Request b alone, as a batch-1 round."""
        s = slice(b, b + 1)
        return Round(self.ph[s], self.logits[s], self.root[s], self.ids, self.vocab_size)


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


def marginal_topk(base: torch.Tensor, k: int, topk=torch.topk):
    lp, tok = topk(torch.log_softmax(base.float(), dim=-1), k, dim=-1)
    return tok, lp


class MarginalScorer(TableScorer):
    """The `marg` arm (and DFlash/DDTree drafts): top-k of the base marginal at each depth."""

    @torch.no_grad()
    def __init__(self, round: Round, k: int):
        super().__init__(round, *round.marginal_topk(k))

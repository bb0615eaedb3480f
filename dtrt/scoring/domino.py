"""Domino's corrected scores over one round's drafter rows: the scorers (dtrt.tree.scorer's protocol) that the
DominoTree builders call with the PyTorch Domino head, in the torch backend and in the exported frontier stage."""

import torch
import torch.nn.functional as F

from dtrt.ops.topm_corrected_score import topm_corrected_score
from dtrt.tree.scorer import Round, TableScorer


class DominoScorer:
    """DominoTree's conditional scorer: Domino's GRU correction along each node's own path.

    Depths below prefix_len use the base marginal over the full vocabulary. Deeper, the corrected logits
    base + W2 . SiLU(W1 [ph_d; s]) are renormalised over the top-`topm` base candidates of that depth
    (topm = 0: the full vocabulary), so those log-probs are not comparable with a full-vocab softmax.
    Its top-ks are torch.topk's, which leave equal values in any order; the exported stages' references take
    OrderedDominoScorer (dtrt.exporter.scorer_stages), whose order among equal values is their graphs'.
    """

    topk = staticmethod(torch.topk)

    @torch.no_grad()
    def __init__(self, round: Round, head, embed: torch.nn.Embedding, k: int, topm: int, prefix_len: int = 1):
        if k < 1 or topm < 0 or prefix_len < 0:
            raise ValueError(f"need k >= 1, topm >= 0, prefix_len >= 0 (got {k}, {topm}, {prefix_len})")
        self.round, self.head, self.embed = round, head, embed
        self.batch, self.depth = round.batch, round.depth
        self.topm = min(topm, round.vocab)
        self.k = min(k, self.topm or round.vocab)
        self.prefix_len = prefix_len
        self.dtype = head.w2.dtype
        w1 = head.embed_proj[0].weight
        # W1 [ph; s] = W_z ph + W_s s: the W_z half is per round, so a node only pays for W_s s
        self.w1s = w1[:, head.hidden :].contiguous()
        self.zp = F.linear(round.ph.to(self.dtype), w1[:, : head.hidden]).float()  # [bs, D, E]
        self.prefix_tokens, self.prefix_logprobs = round.marginal_topk(self.k, min(prefix_len, self.depth), self.topk)
        if self.topm:
            self.cand = self.topk(round.base, self.topm, dim=-1)[1]  # [bs, D, M]
            self.basec = torch.gather(round.base, -1, self.cand).float()
            self.w2c = head.w2[self.cand].float()  # [bs, D, M, E]

    def reads_state(self, depth: int) -> bool:
        return depth >= self.prefix_len

    @torch.no_grad()
    def root_states(self) -> torch.Tensor:
        x = self.embed(self.round.root).to(self.dtype)
        return self.head.gru(x, self.head.zero_state(self.batch, dtype=self.dtype, device=x.device))

    def bottleneck(self, states: torch.Tensor, depth: int) -> torch.Tensor:
        """SiLU(W1 [ph_depth; s]) in fp32, [bs, n, E]."""
        sp = F.linear(states.to(self.dtype), self.w1s).float()
        return F.silu(self.zp[:, depth, None] + sp)

    @torch.no_grad()
    def children(self, states: torch.Tensor, depth: int):
        bs, n = states.shape[:2]
        if depth < self.prefix_len:
            shape = (bs, n, self.k)
            return (
                self.prefix_tokens[:, depth, None].expand(shape),
                self.prefix_logprobs[:, depth, None].expand(shape),
            )
        if self.topm:
            logprobs = topm_corrected_score(
                self.zp[:, depth], states, self.w1s, self.basec[:, depth], self.w2c[:, depth]
            )  # [bs, n, M]
            lp, local = self.topk(logprobs, self.k, dim=-1)
            return torch.gather(self.cand[:, depth, None].expand(bs, n, self.topm), -1, local), lp
        h = self.bottleneck(states, depth)
        corrected = self.round.base[:, depth, None].float() + F.linear(h.to(self.dtype), self.head.w2).float()
        lp, tok = self.topk(torch.log_softmax(corrected, dim=-1), self.k, dim=-1)
        return tok, lp

    @torch.no_grad()
    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.gru(self.embed(tokens).to(self.dtype), states.to(self.dtype))


def greedy_chain_tables(domino):
    """Per-depth (tokens, logprobs) [bs, D, k] of a Domino scorer along its corrected greedy chain: the root
    state, then at each depth the argmax child advances the GRU."""
    s = domino.root_states()[:, None]
    tokens, logprobs = [], []
    for d in range(domino.depth):
        tok, lp = domino.children(s, d)
        tokens.append(tok[:, 0])
        logprobs.append(lp[:, 0])
        if d + 1 < domino.depth:
            s = domino.advance(s, tok[:, :, 0])
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


@torch.no_grad()
def domino_chain(rnd: Round, head, embed, prefix_len: int, scorer=DominoScorer) -> torch.Tensor:
    """Long[bs, D]: Domino's own draft, the corrected argmax at every depth over the full vocabulary (the depths
    below prefix_len take the base marginal's), each advancing the GRU (Domino's chain verification)."""
    return greedy_chain_tables(scorer(rnd, head, embed, 1, 0, prefix_len))[0][..., 0]


class CondStaticScorer(TableScorer):
    """The `condstatic` arm: Domino's correction evaluated once per depth along the greedy chain
    (each depth's argmax advances the GRU), and that table is shared by every node at the depth."""

    @torch.no_grad()
    def __init__(
        self,
        round: Round,
        head,
        embed: torch.nn.Embedding,
        k: int,
        topm: int,
        prefix_len: int = 1,
        domino=None,
    ):
        """`domino`: any Domino scorer over this round (e.g. the ONNX Runtime one) instead of the torch one."""
        domino = domino or DominoScorer(round, head, embed, k, topm, prefix_len)
        super().__init__(round, *greedy_chain_tables(domino))

    @property
    def greedy(self) -> torch.Tensor:
        """Long[bs, D]: the greedy corrected chain (Domino's own draft)."""
        return self.tokens[:, :, 0]

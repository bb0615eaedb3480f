"""The Domino scorer and the frontier builder as exported stages (DESIGN.md section 2: scorer, tree builder).

    scorer_root      root [1] -> state [1, G]                                    GRU(e(root), 0)
    scorer_setup     ph [R, H], base [R, V] fp32                                 once per round
                     -> cand [R, M], basec [R, M] fp32, zproj [R, E] fp32, w2c [R, M, E] fp32
                     (R: the rows the round's block computed, 1..D; cand: the top M of base, equal
                     values in ascending token id, as ONNX TopK orders them: dtrt.tree.topk)
    scorer_children  zproj [E], states [n, G], basec [M], w2c [M, E]             one TopMCorrectedScore node
                     -> logprobs [n, M] fp32
    scorer_advance   tokens [n], states [n, G] -> next_states [n, G]             GRU(e(token), s)
    chain            ph [D, H], base [D, V] fp32, root [1] -> tokens [D]         Domino's chain, full vocabulary
    frontier         ph [bs, D, H], base [bs, D, V] fp32, root [bs]              build_frontier over DominoScorer
                     -> tokens, parents, depths [bs, N], scores [bs, N] fp32, mask [bs, N, N]

The four scorer stages serve the host heap (StageDominoScorer): it takes the top-k of the children's log-probs and
maps candidate indices to tokens through cand, and answers depths below prefix_len from the base marginal itself.
The frontier stage is the whole builder (budget, node_topk, M and D fixed at export), and the chain's depth is fixed
at D too (a loop over the depths); scorer_setup takes the rows a round asked the block for.
M = topm, or the vocabulary when topm = 0: the split stages then renormalise over every token (DominoScorer's
full-vocabulary softmax, up to rounding); the frontier stage keeps DominoScorer's own full-vocabulary path.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dtrt.exporter.stage_modules import Stage
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.target import Target
from dtrt.ops.topm_corrected_score import topm_corrected_score
from dtrt.scoring import DominoScorer, domino_chain
from dtrt.tree.frontier import build_frontier
from dtrt.tree.scorer import Round
from dtrt.tree.topk import topk_lower_first


class OrderedDominoScorer(DominoScorer):
    """DominoScorer whose top-ks order equal values as the exported graphs' TopK does (the lower index first): the
    chain and frontier stages' reference, where a tied base row (a quantized lm_head's) must draft what the graph
    drafts. The torch backend keeps torch.topk, several times cheaper over a large vocabulary."""

    topk = staticmethod(topk_lower_first)


class HeadStage(nn.Module):
    def __init__(self, head: DominoHead, embed: nn.Embedding):
        super().__init__()
        self.head, self.embed = head, embed

    @property
    def dtype(self):
        return self.head.w2.dtype


class ScorerRootStage(HeadStage):
    def forward(self, root):
        x = self.embed(root).to(self.dtype)
        return self.head.gru(x, self.head.zero_state(root.shape[0], dtype=self.dtype, device=x.device))


class ScorerSetupStage(HeadStage):
    def __init__(self, head, embed, topm: int, depth: int):
        super().__init__(head, embed)
        self.topm, self.depth = topm, depth

    def forward(self, ph, base):
        w1 = self.head.embed_proj[0].weight
        zproj = F.linear(ph.to(self.dtype), w1[:, : self.head.hidden]).float()
        cand = topk_lower_first(base, self.topm)[1]  # base ties (a quantized lm_head, -inf outside a draft vocabulary)
        return cand, torch.gather(base, -1, cand).float(), zproj, self.head.w2[cand].float()


class ScorerChildrenStage(HeadStage):
    def __init__(self, head, embed, topm: int):
        super().__init__(head, embed)
        self.topm = topm
        self.register_buffer("w1s", head.embed_proj[0].weight[:, head.hidden :].detach().clone(), persistent=False)

    def forward(self, zproj, states, basec, w2c):
        return topm_corrected_score(zproj[None], states[None], self.w1s, basec[None], w2c[None])[0]


class ScorerAdvanceStage(HeadStage):
    def forward(self, tokens, states):
        return self.head.gru(self.embed(tokens).to(self.dtype), states.to(self.dtype))


class ChainStage(HeadStage):
    """Domino's own chain: the corrected argmax over the full vocabulary at every depth (batch 1)."""

    def __init__(self, head, embed, prefix_len: int, depth: int):
        super().__init__(head, embed)
        self.prefix_len, self.depth = prefix_len, depth

    def forward(self, ph, base, root):
        rnd = Round(ph[None], base[None], root)
        return domino_chain(rnd, self.head, self.embed, self.prefix_len, OrderedDominoScorer)[0]


class FrontierStage(HeadStage):
    def __init__(
        self, head, embed, budget: int, node_topk: int, topm: int, prefix_len: int, depth: int, mask_token_id: int
    ):
        super().__init__(head, embed)
        self.budget, self.node_topk, self.topm, self.prefix_len = budget, node_topk, topm, prefix_len
        self.depth, self.mask_token_id = depth, mask_token_id

    def forward(self, ph, base, root):
        rnd = Round(ph, base, root)
        scorer = OrderedDominoScorer(rnd, self.head, self.embed, self.node_topk, self.topm, self.prefix_len)
        ft = build_frontier(scorer, self.budget, self.depth, self.mask_token_id)
        return ft.tokens, ft.parents, ft.depths, ft.scores, ft.mask


def _root_example(stage, n, p, gen):
    return {"root": torch.randint(0, stage.module.head.vocab, (1,), generator=gen)}


def _rows(head: DominoHead, lead: tuple, depth: int, gen):
    return (
        torch.randn(*lead, depth, head.hidden, generator=gen).to(head.w2.dtype),
        2 * torch.randn(*lead, depth, head.vocab, generator=gen),
    )


def _setup_example(stage, n, p, gen):
    """n: the rows of the round (at most D)."""
    ph, base = _rows(stage.module.head, (), min(n, stage.module.depth), gen)
    return {"ph": ph, "base": base}


def _children_example(stage, n, p, gen):
    head = stage.module.head
    M = stage.module.topm
    return {
        "zproj": torch.randn(head.emb_dim, generator=gen),
        "states": torch.randn(n, head.gru_dim, generator=gen).to(head.w2.dtype),
        "basec": 2 * torch.randn(M, generator=gen),
        "w2c": torch.randn(M, head.emb_dim, generator=gen),
    }


def _advance_example(stage, n, p, gen):
    head = stage.module.head
    return {
        "tokens": torch.randint(0, head.vocab, (n,), generator=gen),
        "states": torch.randn(n, head.gru_dim, generator=gen).to(head.w2.dtype),
    }


def _chain_example(stage, n, p, gen):
    ph, base = _rows(stage.module.head, (), stage.module.depth, gen)
    return {"ph": ph, "base": base, "root": torch.randint(0, stage.module.head.vocab, (1,), generator=gen)}


def _frontier_example(stage, n, p, gen):
    """n requests."""
    ph, base = _rows(stage.module.head, (n,), stage.module.depth, gen)
    return {"ph": ph, "base": base, "root": torch.randint(0, stage.module.head.vocab, (n,), generator=gen)}


def scorer_stages(target: Target, drafter: Drafter, budget: int, topm: int, node_topk: int) -> list[Stage]:
    head, cfg = drafter.head, drafter.cfg
    if head is None:
        raise ValueError("the scorer stages need a drafter with a Domino head")
    if budget < 1 or node_topk < 1 or topm < 0:
        raise ValueError(f"need budget >= 1, node_topk >= 1, topm >= 0 (got {budget}, {node_topk}, {topm})")
    embed, D = target.model.embed_tokens, cfg.k_draft
    M = min(topm, head.vocab) if topm else head.vocab
    nodes = {0: "N"}
    requests = {0: "bs"}
    return [
        Stage("scorer_root", ScorerRootStage(head, embed), ["root"], ["state"], {}, _root_example),
        Stage(
            "scorer_setup",
            ScorerSetupStage(head, embed, M, D),
            ["ph", "base"],
            ["cand", "basec", "zproj", "w2c"],
            {"ph": {0: "R"}, "base": {0: "R"}},
            _setup_example,
        ),
        Stage(
            "scorer_children",
            ScorerChildrenStage(head, embed, M),
            ["zproj", "states", "basec", "w2c"],
            ["logprobs"],
            {"states": nodes},
            _children_example,
        ),
        Stage(
            "scorer_advance",
            ScorerAdvanceStage(head, embed),
            ["tokens", "states"],
            ["next_states"],
            {"tokens": nodes, "states": nodes},
            _advance_example,
        ),
        Stage(
            "chain",
            ChainStage(head, embed, cfg.pure_draft_prefix_len, D),
            ["ph", "base", "root"],
            ["tokens"],
            {},
            _chain_example,
        ),  # fmt: skip
        Stage(
            "frontier",
            FrontierStage(head, embed, budget, node_topk, topm, cfg.pure_draft_prefix_len, D, cfg.mask_token_id),
            ["ph", "base", "root"],
            ["tokens", "parents", "depths", "scores", "mask"],
            {"ph": requests, "base": requests, "root": requests},
            _frontier_example,
        ),
    ]

"""DominoTree's batched frontier builder: fixed shapes, every request at once, no host synchronization.

W = budget lanes per request walk the D depths together; every scored child goes into a ledger, and the tree
is the global top-B of the ledger. A child never outscores its parent, so the top-B set is ancestor-closed,
and with W = B every top-B node's parent survives each keep step: on tie-free input this selects exactly the
heap's tree, in the heap's pop order.
"""

from dataclasses import dataclass

import torch

from dtrt.ops.ledger_select import ledger_select
from dtrt.tree.tree import Tree, pack_mask


@dataclass
class FrontierTrees:
    tokens: torch.Tensor  # Long[bs, N], N = budget + 1, column 0 = root
    parents: torch.Tensor  # Long[bs, N], root -1
    depths: torch.Tensor  # Long[bs, N], root 0
    scores: torch.Tensor  # float32[bs, N], root 0, padding -inf
    mask: torch.Tensor  # Bool[bs, N, N], ancestors + self

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def positions(self, past) -> torch.Tensor:
        """past: int or Long[bs]."""
        return torch.as_tensor(past, device=self.depths.device).reshape(-1, 1) + self.depths

    def packed_mask(self) -> torch.Tensor:
        return pack_mask(self.mask)

    def tree(self, b: int) -> Tree:
        """Request b without its padding leaves (they sit after every real node)."""
        n = int(torch.isfinite(self.scores[b]).sum())
        return Tree(
            self.tokens[b, :n], self.parents[b, :n], self.depths[b, :n], self.scores[b, :n], self.mask[b, :n, :n]
        )

    def whole(self, b: int) -> Tree:
        """Request b with its padding leaves, budget + 1 nodes, copied out: no host read (`tree` counts the real
        nodes), which is what a drafting graph hands the verify. A padding leaf sits under the root with
        mask_token_id and score -inf; it is accepted only where its token is the target's own choice, as any node
        is, so it costs a verify row and never changes the output."""
        return Tree(*(t[b].clone() for t in (self.tokens, self.parents, self.depths, self.scores, self.mask)))


def _stable_top(x: torch.Tensor, k: int):
    """The first k along dim 1 of a stable descending sort. torch.onnx exports no stable sort, but ONNX TopK
    breaks ties by the lower index, which is the same order."""
    if torch.onnx.is_in_onnx_export():
        return torch.topk(x, k, dim=1)
    values, index = torch.sort(x, dim=1, descending=True, stable=True)
    return values[:, :k], index[:, :k]


@torch.no_grad()
def build_frontier(scorer, budget: int, max_depth: int, mask_token_id: int) -> FrontierTrees:
    """Padding slots (fewer than budget reachable nodes) become mask_token_id leaves under the root."""
    if budget < 1 or max_depth < 1:
        raise ValueError(f"need budget >= 1 and max_depth >= 1 (got {budget}, {max_depth})")
    D, W, k = min(max_depth, scorer.depth), budget, scorer.k
    Wk = W * k
    root_states = scorer.root_states()
    bs, G = root_states.shape
    dev = root_states.device
    neg_inf = float("-inf")

    # lane 0 is the root; -inf lanes flow through every op and poison all their descendants
    lane_scores = torch.full((bs, W), neg_inf, device=dev)
    lane_scores[:, 0] = 0.0
    lane_states = root_states[:, None].expand(bs, W, G)
    lane_node = torch.full((bs, W), -1, dtype=torch.long, device=dev)  # ledger index of each lane, -1 = root

    ledger_scores = torch.full((bs, D, Wk), neg_inf, device=dev)
    ledger_tokens = torch.zeros((bs, D, Wk), dtype=torch.long, device=dev)
    ledger_parents = torch.full((bs, D, Wk), -1, dtype=torch.long, device=dev)

    for d in range(D):
        tokens, logprobs = scorer.children(lane_states, d)  # [bs, W, k]
        cum = (lane_scores[..., None] + logprobs).reshape(bs, Wk)
        tokens = tokens.reshape(bs, Wk)
        ledger_scores[:, d] = cum
        ledger_tokens[:, d] = tokens
        ledger_parents[:, d] = lane_node[..., None].expand(bs, W, k).reshape(bs, Wk)
        if d + 1 < D:
            kept_scores, kept = _stable_top(cum, W)
            parent_states = torch.gather(lane_states, 1, (kept // k)[..., None].expand(bs, W, G))
            lane_states = scorer.advance(parent_states, torch.gather(tokens, 1, kept))
            lane_scores = kept_scores
            lane_node = d * Wk + kept

    # selection: the first B of a stable descending sort of the depth-major ledger, so on a score tie a
    # parent (shallower) still precedes its child
    tokens, parents, depths, scores, mask = ledger_select(
        ledger_scores, ledger_tokens, ledger_parents, scorer.round.root, budget, mask_token_id
    )
    return FrontierTrees(tokens, parents, depths, scores, mask)

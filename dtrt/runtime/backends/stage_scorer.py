"""Domino's scorer over the exported scorer stages, batch 1, for the host heap builder (ONNX Runtime and TensorRT
alike: it calls the stages through the backend's StageRunner).

The stages are those of dtrt.exporter.scorer_stages: scorer_root, scorer_setup (once per round), scorer_children
and scorer_advance (per expansion). The top-k over the M candidates and the candidate -> token map run here, as
do the depths below prefix_len, which take the base marginal's top-k as dtrt.scoring.DominoScorer does.
"""

import torch

from dtrt.tree.scorer import MarginalScorer, Round


class StageDominoScorer:
    def __init__(self, run, rnd: Round, k: int, prefix_len: int):
        """`run(stage, **feeds)` runs an exported stage (a StageRunner)."""
        if rnd.batch != 1:
            raise ValueError(f"StageDominoScorer scores one request; the round holds {rnd.batch}")
        if k < 1 or prefix_len < 0:
            raise ValueError(f"need k >= 1 and prefix_len >= 0 (got {k}, {prefix_len})")
        self.run, self.round = run, rnd
        self.batch, self.depth, self.prefix_len = 1, rnd.depth, prefix_len
        out = run("domino.scorer_setup", ph=rnd.ph[0], base=rnd.base[0])
        self.cand, self.basec, self.zproj, self.w2c = out["cand"], out["basec"], out["zproj"], out["w2c"]
        self.k = min(k, self.cand.shape[1])
        p = min(prefix_len, self.depth)
        self.prefix = MarginalScorer(Round(rnd.ph[:, :p], rnd.base[:, :p], rnd.root), self.k) if p else None

    def root_states(self) -> torch.Tensor:
        return self.run("domino.scorer_root", root=self.round.root[:1])["state"]

    def children(self, states: torch.Tensor, depth: int):
        """states [1, n, G] -> tokens Long[1, n, k], logprobs float32[1, n, k]."""
        if depth < self.prefix_len:
            return self.prefix.children(states, depth)
        out = self.run(
            "domino.scorer_children",
            zproj=self.zproj[depth],
            states=states[0],
            basec=self.basec[depth],
            w2c=self.w2c[depth],
        )
        lp, local = torch.topk(out["logprobs"], self.k, dim=-1)
        return self.cand[depth][local][None], lp[None]

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """states [1, n, G], tokens Long[1, n] -> [1, n, G]."""
        return self.run("domino.scorer_advance", tokens=tokens[0], states=states[0])["next_states"][None]

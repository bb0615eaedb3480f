"""Domino's scorer over the exported scorer stages, batch 1, for the host heap builder (ONNX Runtime and TensorRT
alike: it calls the stages through the backend's StageRunner).

The stages are those of dtrt.exporter.scorer_stages: scorer_root, scorer_setup (once per round), scorer_children
and scorer_advance (per expansion). The top-k over the M candidates and the candidate -> token map run here, as
do the depths below prefix_len, which take the base marginal's top-k as dtrt.scoring.DominoScorer does.
Each stage runs when a builder first needs what it gives: a tree that never leaves the prefix depths (budget 1,
prefix_len 1) runs none.
"""

import torch

from dtrt.tree.scorer import MarginalScorer, Round


class StageDominoScorer:
    def __init__(self, run, rnd: Round, k: int, prefix_len: int, topm: int):
        """`run(stage, **feeds)` runs an exported stage (a StageRunner); `topm` is the one the stages were exported
        with (0: the full vocabulary)."""
        if rnd.batch != 1:
            raise ValueError(f"StageDominoScorer scores one request; the round holds {rnd.batch}")
        if k < 1 or prefix_len < 0:
            raise ValueError(f"need k >= 1 and prefix_len >= 0 (got {k}, {prefix_len})")
        self.run, self.round = run, rnd
        self.batch, self.depth, self.prefix_len = 1, rnd.depth, prefix_len
        self.k = min(k, min(topm, rnd.vocab) or rnd.vocab)
        self._setup = None
        p = min(prefix_len, self.depth)
        self.prefix = MarginalScorer(rnd.prefix(p), self.k) if p else None

    def setup(self) -> dict[str, torch.Tensor]:
        """The round's candidates and their per-depth terms (cand, basec, zproj, w2c), from the setup stage once."""
        if self._setup is None:
            self._setup = self.run("domino.scorer_setup", ph=self.round.ph[0], base=self.round.base[0])
        return self._setup

    def reads_state(self, depth: int) -> bool:
        return depth >= self.prefix_len

    def root_states(self) -> torch.Tensor:
        return self.run("domino.scorer_root", root=self.round.root[:1])["state"]

    def children(self, states: torch.Tensor, depth: int):
        """states [1, n, G] -> tokens Long[1, n, k], logprobs float32[1, n, k]."""
        if depth < self.prefix_len:
            return self.prefix.children(states, depth)
        s = self.setup()
        zproj, basec, w2c = s["zproj"][depth], s["basec"][depth], s["w2c"][depth]
        out = self.run("domino.scorer_children", zproj=zproj, states=states[0], basec=basec, w2c=w2c)
        lp, local = torch.topk(out["logprobs"], self.k, dim=-1)
        return s["cand"][depth][local][None], lp[None]

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """states [1, n, G], tokens Long[1, n] -> [1, n, G]."""
        return self.run("domino.scorer_advance", tokens=tokens[0], states=states[0])["next_states"][None]

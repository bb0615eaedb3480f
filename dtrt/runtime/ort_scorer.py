"""DominoScorer over the exported scorer stages in ONNX Runtime, batch 1, for the host heap builder.

The sessions are the stages of `dtrt.exporter.scorer_stages` by name: scorer_root, scorer_setup (once per round),
scorer_children and scorer_advance (per expansion). The top-k over the M candidates and the candidate -> token
map run here, as do the depths below prefix_len, which take the base marginal's top-k like DominoScorer does.
"""

import numpy as np
import torch

from dtrt.tree.scorer import MarginalScorer, Round


def _feed(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().cpu().numpy())


class OrtDominoScorer:
    def __init__(self, sessions: dict, rnd: Round, k: int, prefix_len: int):
        if rnd.batch != 1:
            raise ValueError(f"OrtDominoScorer scores one request; the round holds {rnd.batch}")
        if k < 1 or prefix_len < 0:
            raise ValueError(f"need k >= 1 and prefix_len >= 0 (got {k}, {prefix_len})")
        self.sessions, self.round = sessions, rnd
        self.batch, self.depth, self.prefix_len = 1, rnd.depth, prefix_len
        cand, self.basec, self.zproj, self.w2c = self._run("scorer_setup", ph=rnd.ph[0], base=rnd.base[0])
        self.cand = torch.from_numpy(cand)  # [D, M]
        self.k = min(k, self.cand.shape[1])
        p = min(prefix_len, self.depth)
        self.prefix = MarginalScorer(Round(rnd.ph[:, :p], rnd.base[:, :p], rnd.root), self.k) if p else None

    def _run(self, stage: str, **inputs) -> list[np.ndarray]:
        feeds = {name: x if isinstance(x, np.ndarray) else _feed(x) for name, x in inputs.items()}
        return self.sessions[stage].run(None, feeds)

    def root_states(self) -> torch.Tensor:
        return torch.from_numpy(self._run("scorer_root", root=self.round.root[:1])[0])

    def children(self, states: torch.Tensor, depth: int):
        """states [1, n, G] -> tokens Long[1, n, k], logprobs float32[1, n, k]."""
        if depth < self.prefix_len:
            return self.prefix.children(states, depth)
        (logprobs,) = self._run(
            "scorer_children", zproj=self.zproj[depth], states=states[0], basec=self.basec[depth], w2c=self.w2c[depth]
        )
        lp, local = torch.topk(torch.from_numpy(logprobs), self.k, dim=-1)
        return self.cand[depth][local][None], lp[None]

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """states [1, n, G], tokens Long[1, n] -> [1, n, G]."""
        return torch.from_numpy(self._run("scorer_advance", tokens=tokens[0], states=states[0])[0])[None]

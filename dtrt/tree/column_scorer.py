"""A scorer (dtrt.tree.scorer's protocol) that wraps another and keeps one number of its own per node: the wrapped
scorer's state with one more column, in float64, which holds the wrapped states (fp32, bf16, fp16) and an integer
index exactly. Lookup's trie node (dtrt.tree.lookup_scorer) and a grammar's path (dtrt.tree.grammar) ride in it."""

import torch


class ColumnScorer:
    """`inner`'s protocol passed through for one request; subclasses read the column with `_split` and write it
    with `_join`, and start every root at column value 0."""

    def __init__(self, inner):
        if inner.batch != 1:
            raise ValueError(f"{type(self).__name__} scores one request; the scorer holds {inner.batch}")
        self.inner = inner
        self.round, self.batch, self.depth, self.k = inner.round, inner.batch, inner.depth, inner.k
        self.dtype = None

    def _split(self, states: torch.Tensor):
        return states[..., :-1].to(self.dtype), states[..., -1].long()

    def _join(self, states: torch.Tensor, at) -> torch.Tensor:
        at = torch.as_tensor(at, dtype=torch.float64, device=states.device).reshape(*states.shape[:-1], 1)
        return torch.cat([states.to(torch.float64), at], dim=-1)

    def root_states(self) -> torch.Tensor:
        s = self.inner.root_states()
        self.dtype = s.dtype
        return self._join(s, [0] * s.shape[0])

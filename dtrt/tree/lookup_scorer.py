"""Lookup chains as extra children for the heap builder: a scorer (dtrt.tree.scorer's protocol) that wraps the
drafter's and adds, at each node on a lookup chain, the chain's next token with its estimated log-acceptance.

The chains form a trie (node 0: the round's root; `Trie.children[i]`: token -> trie node). A state is the wrapped
scorer's state with one more column, the node's trie node (-1: off every chain), in float64, which holds the
wrapped states (fp32, bf16, fp16) and the trie index exactly. A chain token equal to a drafter child of the same
node is that child, scored by the better of its two estimates; off the chains the wrapped scorer's children are
returned unchanged, so with no chain the tree is the one the wrapped scorer builds."""

from dataclasses import dataclass, field

import torch

from dtrt.tree.column_scorer import ColumnScorer
from dtrt.tree.tree import Tree


@dataclass
class Trie:
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    @classmethod
    def of(cls, chains) -> "Trie":
        trie = cls()
        for chain in chains:
            at = 0
            for t in chain:
                nxt = trie.children[at].get(int(t))
                if nxt is None:
                    nxt = trie.children[at][int(t)] = len(trie.children)
                    trie.children.append({})
                at = nxt
        return trie

    def nodes(self, tree: Tree) -> list[int]:
        """The trie node of each tree node (-1: not a lookup node): a node is one when its parent is (the root is
        trie node 0) and its token is a chain's next token there, exactly as LookupScorer grew it."""
        at = [0] * len(tree)
        for i, (t, p) in enumerate(zip(tree.tokens.tolist()[1:], tree.parents.tolist()[1:]), 1):
            at[i] = self.children[at[p]].get(t, -1) if at[p] >= 0 else -1
        return at


class LookupScorer(ColumnScorer):
    """`inner`'s children, and the trie's at each node on it, a child at draft depth d scored log_accept[d]."""

    def __init__(self, inner, trie: Trie, log_accept: list[float]):
        super().__init__(inner)
        self.trie, self.log_accept = trie, log_accept

    def children(self, states: torch.Tensor, depth: int):
        inner, at = self._split(states)
        tokens, logprobs = self.inner.children(inner, depth)
        ats = at.flatten().tolist()
        if all(a < 0 or not self.trie.children[a] for a in ats):
            return tokens, logprobs
        if len(ats) != 1:
            raise ValueError(f"LookupScorer adds children one node at a time (the heap builder's); got {len(ats)}")
        toks, lps = with_chain_children(
            tokens[0, 0].tolist(), logprobs[0, 0].tolist(), self.trie.children[ats[0]], self.log_accept[depth]
        )
        return (
            torch.tensor(toks, dtype=tokens.dtype, device=tokens.device)[None, None],
            torch.tensor(lps, dtype=logprobs.dtype, device=logprobs.device)[None, None],
        )

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        inner, at = self._split(states)
        nxt = [
            self.trie.children[a].get(t, -1) if a >= 0 else -1
            for a, t in zip(at.flatten().tolist(), tokens.flatten().tolist())
        ]
        return self._join(self.inner.advance(inner, tokens), nxt)


def with_chain_children(tokens: list[int], logprobs: list[float], chain_tokens, log_accept: float):
    """A node's drafter children (tokens, log-probs, best first) with the lookup chains' next tokens there added
    after them at `log_accept`; a chain token that is a drafter child keeps the better of its two scores."""
    tokens, logprobs = list(tokens), list(logprobs)
    for t in chain_tokens:
        if t in tokens:
            j = tokens.index(t)
            logprobs[j] = max(logprobs[j], log_accept)
        else:
            tokens.append(t)
            logprobs.append(log_accept)
    return tokens, logprobs

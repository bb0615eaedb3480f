"""A grammar's masks where a tree is built: the heap builder's scorer wrapped so that a node's children are only the
tokens the grammar allows at its path (the one allowed token, at log-prob 0, where the grammar forces it), and any
method's tree fitted: nodes the grammar forbids dropped with their subtrees, forced tokens added below the leaves.

`masks` answers `allows(path, token)` and `forced(path)` (dtrt.runtime.grammar.GrammarState), a path being the tuple
of tokens after the round's root. Nothing here imports the grammar engine."""

import torch

from dtrt.tree.column_scorer import ColumnScorer
from dtrt.tree.tree import Tree


def paths(tree: Tree) -> list[tuple]:
    """Each node's path: the tokens from the root's child down to it (the root's: ())."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out: list[tuple] = [()]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + (tokens[i],))
    return out


def fit_tree(tree: Tree, masks, *, room: int, max_depth: int | None = None) -> Tree:
    """`tree` without the nodes the grammar forbids at their parent's path (and their subtrees), then each leaf's
    forced tokens appended below it while the tree holds at most `room` draft nodes and `max_depth` depths: a
    forced token is the target's choice under the mask whatever its logits, so it is accepted with its parent."""
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    index, kept = [0] + [-1] * (len(tokens) - 1), [0]
    node_paths: list[tuple] = [()]
    for i in range(1, len(tokens)):
        p = index[parents[i]]
        if p < 0 or not masks.allows(node_paths[p], tokens[i]):
            continue
        index[i] = len(kept)
        kept.append(i)
        node_paths.append(node_paths[p] + (tokens[i],))
    out_tokens = [tokens[i] for i in kept]
    out_parents = [-1] + [index[parents[i]] for i in kept[1:]]
    out_scores = [scores[i] for i in kept]
    has_child = {p for p in out_parents[1:]}
    limit = max_depth if max_depth is not None else room
    for leaf in [j for j in range(len(out_tokens)) if j not in has_child]:
        at = leaf
        while len(out_tokens) - 1 < room and len(node_paths[at]) < limit:
            t = masks.forced(node_paths[at])
            if t is None:
                break
            out_tokens.append(t)
            out_parents.append(at)
            out_scores.append(out_scores[at])
            node_paths.append(node_paths[at] + (t,))
            at = len(out_tokens) - 1
    if len(out_tokens) == len(tokens):
        return tree
    if len(out_tokens) == 1:
        return Tree.chain([], root=out_tokens[0])
    return Tree.from_parents(out_tokens, out_parents, out_scores)


class GrammarScorer(ColumnScorer):
    """`inner`'s children at each node, kept where the grammar allows them at the node's path; where it forces one
    token, that token alone at log-prob 0 (the node's score carries over). A state is the inner state with one more
    column, the index of the node's path in this round's list of paths (float64, as LookupScorer's trie column)."""

    def __init__(self, inner, masks):
        super().__init__(inner)
        self.masks = masks
        self.paths: list[tuple] = [()]

    def reads_state(self, depth: int) -> bool:
        return True  # the path column, whatever the inner scorer reads

    def children(self, states: torch.Tensor, depth: int):
        inner, at = self._split(states)
        ats = at.flatten().tolist()
        if len(ats) != 1:
            raise ValueError(f"GrammarScorer scores one node at a time (the heap builder's); got {len(ats)}")
        path = self.paths[ats[0]]
        tokens, logprobs = self.inner.children(inner, depth)
        forced = self.masks.forced(path)
        if forced is not None:
            toks, lps = [forced], [0.0]
        else:
            pairs = [
                (t, lp) for t, lp in zip(tokens[0, 0].tolist(), logprobs[0, 0].tolist()) if self.masks.allows(path, t)
            ]
            toks, lps = [t for t, _ in pairs], [lp for _, lp in pairs]
        return (
            torch.tensor(toks, dtype=tokens.dtype, device=tokens.device).reshape(1, 1, -1),
            torch.tensor(lps, dtype=logprobs.dtype, device=logprobs.device).reshape(1, 1, -1),
        )

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        inner, at = self._split(states)
        nxt = []
        for a, t in zip(at.flatten().tolist(), tokens.flatten().tolist()):
            self.paths.append(self.paths[a] + (t,))
            nxt.append(len(self.paths) - 1)
        return self._join(self.inner.advance(inner, tokens), nxt)

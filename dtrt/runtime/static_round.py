"""A verify round at a fixed width, on the device: the tree padded to the next of WIDTHS with dead leaves, the
tree's mask and positions made from its parents, the target's call over the static cache, the accept walk (T=0,
or T>0 with every row's draw made on the device), the commit and the drafter's context of the accepted rows, all as
tensor operations with no host value and no host sync inside (`device_round`), so that torch.compile(fullgraph=True)
takes it whole and a CUDA graph can capture it. `StaticRound` runs it: one CUDA graph per width (and sampling mode),
captured at its first use and replayed (on a CPU it runs eagerly).

A dead leaf (a padding slot) has no parent: it sees only itself (a row that sees nothing would be NaN, and NaN
values would reach the live rows through their zero weights), no node sees it, and it is never accepted nor
committed, whatever its token.
"""

import torch

from dtrt.runtime.sampling import draw_rows
from dtrt.tree import Tree

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def width_for(n: int) -> int:
    """The smallest of WIDTHS that holds `n` nodes."""
    for w in WIDTHS:
        if n <= w:
            return w
    raise ValueError(f"a tree of {n} nodes is wider than the widest static verify ({WIDTHS[-1]})")


def padded(tree: Tree, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [width], parents [width]) of `tree` with dead leaves after its nodes: token 0, parent -1. On the
    tree's device: a tree the drafting graph left on the GPU goes to the verify without a wait on the host."""
    n, device = len(tree), tree.tokens.device
    tokens = torch.zeros(width, dtype=torch.long, device=device)
    parents = torch.full((width,), -1, dtype=torch.long, device=device)
    tokens[:n], parents[:n] = tree.tokens, tree.parents
    return tokens, parents


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Bool [W, W]: row i holds i and its ancestors (the tree's mask). Parent links are closed by repeated squaring:
    six products close paths of up to 64 nodes, the widest width, at any width (so a step compiled for one width
    serves the others), and no host loop runs over nodes."""
    w = parents.shape[0]
    index = torch.arange(w, device=parents.device)
    reach = ((parents[:, None] == index[None, :]) | (index[:, None] == index[None, :])).float()
    for _ in range((WIDTHS[-1] - 1).bit_length()):
        reach = ((reach @ reach) > 0).float()
    return reach > 0


def walk(tokens, parents, mask, choice):
    """The accept walk as tensors: node i (i > 0) matches where it has a parent (a dead leaf has none) and its token
    is the target's choice at its parent, an earlier sibling of the same token winning (as dtrt.tree.accept); a node
    is accepted where it and all its ancestors match. Returns (accepted bool [W], order [W]: the accepted nodes
    first, ascending, count, bonus: the choice at the deepest accepted node)."""
    w = tokens.shape[0]
    index = torch.arange(w, device=tokens.device)
    matches = (tokens == choice[parents.clamp(min=0)]) & (parents >= 0)
    same = (parents[:, None] == parents[None, :]) & (tokens[:, None] == tokens[None, :])
    same &= index[None, :] < index[:, None]
    earlier = (same & matches[None, :]).any(-1)
    matches = (matches & ~earlier) | (index == 0)
    accepted = ~(mask & ~matches[None, :]).any(-1)
    count = accepted.sum()
    depth = mask.sum(-1)
    deepest = torch.argmax(torch.where(accepted, depth, 0))
    order = torch.argsort((~accepted).to(torch.int8) * w + index)  # accepted first, then the rest, each ascending
    return accepted, order, count, choice.gather(0, deepest.view(1))[0]


def verify_at_width(target, cache, taps, tokens, parents):
    """The padded tree's verify over the static cache: (logits [W, V], hidden [W, taps*H], mask [W, W])."""
    mask = ancestors(parents)
    positions = cache.length + mask.sum(-1) - 1
    cache.static = True
    try:
        logits, hidden = target(tokens, positions, mask, cache, taps=taps)
    finally:
        cache.static = False
    return logits, hidden, mask


class ContextAppend:
    """The drafter's context of a round's accepted rows appended inside the round: the context K/V of all W rows in
    walk order (the accepted first) written after the draft cache's committed `length` (a device tensor), which
    advances by the accepted count; the other rows land past it, unread, in the W slots of slack the cache keeps."""

    def __init__(self, drafter, draft_cache):
        self.drafter, self.cache = drafter, draft_cache
        self.length = torch.zeros((), dtype=torch.long, device=draft_cache.k.device)

    def __call__(self, rows, start, count):
        """rows [W, taps*H] in walk order, the root's position `start` and `count`, device tensors."""
        index = torch.arange(rows.shape[0], device=rows.device)
        k, v = zip(*self.drafter.context_kv(rows.to(self.drafter.dtype), start + index))
        # one write into each whole buffer: a compiled step writes it in place (a write into each layer's view
        # would be compiled into a copy of the layer)
        self.cache.k.index_copy_(2, self.length + index, torch.stack(k))
        self.cache.v.index_copy_(2, self.length + index, torch.stack(v))
        self.length.add_(count)


class Sampled:
    """The T>0 choice at every row of a round, on the device (`draw_rows`): the token after row i is drawn with
    the uniform of the position it lands at, read from `uniforms` (float64: a generation's table, Draws in
    dtrt.runtime.sampling), with device scalars `temperature` and `top_p`; `nucleus`: whether top_p filters."""

    def __init__(self, uniforms, temperature, top_p, *, nucleus: bool):
        self.uniforms, self.temperature, self.top_p, self.nucleus = uniforms, temperature, top_p, nucleus

    def __call__(self, logits, positions):
        u = self.uniforms.index_select(0, positions)
        return draw_rows(logits, self.temperature, self.top_p, u, nucleus=self.nucleus)


def device_round(target, cache, taps, tokens, parents, context: ContextAppend | None = None, sampled=None):
    """One round at the width of `tokens`: verify, accept walk (the target's argmax at each row, or with `sampled`
    its T>0 draw), commit into the static cache (and, with a `context`, the accepted rows' drafter context into its
    cache). Returns (logits, hidden, order, count, bonus), all on the device; cache.length (and context.length) have
    advanced by count."""
    logits, hidden, mask = verify_at_width(target, cache, taps, tokens, parents)
    # the token after row i lands one past it: the cache's length plus i's depth (the root's is 0) plus one
    choice = logits.argmax(-1) if sampled is None else sampled(logits, cache.length + mask.sum(-1))
    _, order, count, bonus = walk(tokens, parents, mask, choice)
    cache.commit_order(order, count)
    if context is not None:  # the root's position: the length before the commit
        context(hidden.index_select(0, order), cache.length - count, count)
    return logits, hidden, order, count, bonus

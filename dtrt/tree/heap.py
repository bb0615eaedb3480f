"""DominoTree's sequential best-first builder (batch 1, host heap): the reference the frontier must match."""

import heapq
import itertools

import torch

from dtrt.tree.tree import Tree


@torch.no_grad()
def build_heap(scorer, budget: int, max_depth: int, stop=None) -> Tree:
    """Pop the highest cumulative log-prob first (ties FIFO); each pop is the next node and pushes its k children.

    Tree index = 1 + pop order, so scores are non-increasing in index and parents precede children; any prefix
    of the pop order is a tree. `stop` (optional, as build_ddtree's): start() once, then admit(n_nodes_so_far,
    logw) for each popped node; building ends at the first False (the cost-aware budget of cadominotree).
    """
    if scorer.batch != 1:
        raise ValueError(f"build_heap builds one tree; the scorer holds {scorer.batch} requests")
    depth_limit = min(max_depth, scorer.depth)
    heap: list = []
    counter = itertools.count()

    def push(state, cum: float, depth: int, parent: int):
        tokens, logprobs = scorer.children(state, depth)  # [1, 1, k]
        # float32 sums, exactly as the frontier accumulates them
        cums = (logprobs[0, 0] + cum).tolist()
        states = None
        if depth + 1 < depth_limit:  # leaves at the depth limit are never expanded
            states = scorer.advance(state.expand(1, tokens.shape[-1], state.shape[-1]), tokens[:, 0])
        for j, tok in enumerate(tokens[0, 0].tolist()):
            child = None if states is None else states[:, j : j + 1]
            heapq.heappush(heap, (-cums[j], next(counter), tok, depth, parent, child))

    tokens, parents, scores = [int(scorer.round.root[0])], [-1], [0.0]
    if stop is not None:
        stop.start()
    if budget > 0 and depth_limit > 0:
        push(scorer.root_states()[:, None], 0.0, 0, 0)
    while heap and len(tokens) <= budget:
        neg_cum, _, tok, depth, parent, state = heapq.heappop(heap)
        if stop is not None and not stop.admit(len(tokens) - 1, -neg_cum):
            break
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg_cum)
        if len(tokens) > budget:
            break
        if depth + 1 < depth_limit:
            push(state, -neg_cum, depth + 1, len(tokens) - 1)
    return Tree.from_parents(tokens, parents, scores)

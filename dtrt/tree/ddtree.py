"""DDTree: best-first enumeration of the most likely prefixes under the product of per-depth marginals."""

import heapq

import torch

from dtrt.tree.tree import Tree


@torch.no_grad()
def build_ddtree(
    logprobs: torch.Tensor, budget: int, stop=None, root: int = 0, ids: torch.Tensor | None = None, masks=None
) -> Tree:
    """logprobs [D, V]: per-depth log-probabilities (rows of a log_softmax), depth 0 first; `ids`: the token of each
    column where the rows cover a draft vocabulary (None: column = token).

    A lazy heap pops the best remaining prefix; each pop appends a node and pushes its next sibling
    (same parent, rank + 1) and its first child (depth + 1, rank 0), so the tree holds the top-`budget`
    prefixes, in non-increasing order. Ties go to the lexicographically smaller rank tuple.
    `stop` (optional): start() once, then admit(n_nodes_so_far, logw) for each popped candidate;
    building ends at the first False (CaDDTree's cost-aware budget).
    `masks` (optional, dtrt.tree.grammar's): a candidate the grammar forbids at its parent's path is skipped (its
    next sibling still pushed), so the budget goes to tokens that can be accepted.
    """
    tokens, parents, scores = [int(root)], [-1], [0.0]
    D = logprobs.shape[0]
    if stop is not None:
        stop.start()
    if D == 0 or budget < 1:
        return Tree.from_parents(tokens, parents, scores)
    K = min(budget, logprobs.shape[1])
    top_lp, top_tok = torch.topk(logprobs.float(), K, dim=-1)
    if ids is not None:
        top_tok = ids[top_tok]
    top_lp, top_tok = top_lp.tolist(), top_tok.tolist()

    # (-logw, ranks, parent, depth (1-based), rank, logw, parent logw)
    heap = [(-top_lp[0][0], (0,), 0, 1, 0, top_lp[0][0], 0.0)]
    paths: list[tuple] = [()]
    while heap and len(tokens) <= budget:
        _, ranks, parent, depth, rank, logw, parent_logw = heapq.heappop(heap)
        tok = top_tok[depth - 1][rank]
        allowed = masks is None or masks.allows(paths[parent], tok)
        if allowed and stop is not None and not stop.admit(len(tokens) - 1, logw):
            break
        if rank + 1 < K:
            sibling = parent_logw + top_lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling, parent_logw))
        if not allowed:
            continue
        tokens.append(tok)
        parents.append(parent)
        scores.append(logw)
        index = len(tokens) - 1
        if masks is not None:
            paths.append(paths[parent] + (tok,))
        if depth < D:
            child = logw + top_lp[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child, logw))
    return Tree.from_parents(tokens, parents, scores)

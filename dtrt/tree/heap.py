"""DominoTree's sequential best-first builder (batch 1, host heap): the reference the frontier must match."""

import heapq
import itertools

import torch

from dtrt.tree.lookup_scorer import with_chain_children
from dtrt.tree.tree import Tree


def reads_state(scorer, depth: int) -> bool:
    """Whether `scorer.children(states, depth)` reads the states (Domino's depths below prefix_len and the tables do
    not: they take the base marginal whatever the path); a scorer that does not say reads them."""
    says = getattr(scorer, "reads_state", None)
    return True if says is None else says(depth)


@torch.no_grad()
def build_heap(scorer, budget: int, max_depth: int, stop=None) -> Tree:
    """Pop the highest cumulative log-prob first (ties FIFO); each pop is the next node and pushes its k children.

    Tree index = 1 + pop order, so scores are non-increasing in index and parents precede children; any prefix
    of the pop order is a tree. `stop` (optional, as build_ddtree's): start() once, then admit(n_nodes_so_far,
    logw) for each popped node; building ends at the first False (the cost-aware budget of cadominotree).

    States are computed on demand: a node's state (scorer.advance of its parent's) only when the node is popped and
    expanded, the root's only when a child of it is or its children read it. The pops, hence the tree, are those of
    advancing every pushed child, at a fraction of the calls: a budget-1 tree over a scorer whose first depth
    reads no state costs one children() call.
    """
    if scorer.batch != 1:
        raise ValueError(f"build_heap builds one tree; the scorer holds {scorer.batch} requests")
    depth_limit = min(max_depth, scorer.depth)
    heap: list = []
    counter = itertools.count()
    root_state = []

    def root() -> torch.Tensor:
        if not root_state:
            root_state.append(scorer.root_states()[:, None])
        return root_state[0]

    def push(state, cum: float, depth: int, parent: int):
        """Push the children of node `parent` (at `depth`), whose state is `state` (or `root`, not yet computed)."""
        if state is root:
            state = root() if reads_state(scorer, depth) else torch.zeros(1, 1, 1)
            parent_state = root
        else:
            parent_state = state
        tokens, logprobs = scorer.children(state, depth)  # [1, 1, k]
        # float32 sums, exactly as the frontier accumulates them
        cums = (logprobs[0, 0] + cum).tolist()
        for j, tok in enumerate(tokens[0, 0].tolist()):
            heapq.heappush(heap, (-cums[j], next(counter), tok, depth, parent, parent_state))

    tokens, parents, scores = [int(scorer.round.root[0])], [-1], [0.0]
    if stop is not None:
        stop.start()
    if budget == 1 and depth_limit > 0:
        return _best_child(scorer, root() if reads_state(scorer, 0) else torch.zeros(1, 1, 1), tokens[0], stop)
    if budget > 0 and depth_limit > 0:
        push(root, 0.0, 0, 0)
    while heap and len(tokens) <= budget:
        neg_cum, _, tok, depth, parent, parent_state = heapq.heappop(heap)
        if stop is not None and not stop.admit(len(tokens) - 1, -neg_cum):
            break
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg_cum)
        if len(tokens) > budget:
            break
        if depth + 1 < depth_limit:
            above = root() if parent_state is root else parent_state
            state = scorer.advance(above, torch.tensor([[tok]], device=scorer.round.root.device))
            push(state, -neg_cum, depth + 1, len(tokens) - 1)
    return Tree.from_parents(tokens, parents, scores)


def _best_child(scorer, state: torch.Tensor, root: int, stop) -> Tree:
    """build_heap's tree of budget 1 without the heap: its one pop is the root's child of the highest log-prob, the
    first of equals (the heap breaks ties first in, first out), admitted or not by `stop`."""
    tokens, logprobs = scorer.children(state, 0)
    cums = (logprobs[0, 0] + 0.0).tolist()  # float32 sums, as push makes them
    if not cums:
        return Tree.chain([], root=root)
    j = cums.index(max(cums))
    if stop is not None and not stop.admit(0, cums[j]):
        return Tree.chain([], root=root)
    return Tree.one_child(root, int(tokens[0, 0, j]), cums[j])


@torch.no_grad()
def best_marginal_child(
    logits: torch.Tensor,
    root: int,
    k: int,
    ids: torch.Tensor | None = None,
    stop=None,
    chain: tuple[int, ...] = (),
    log_accept: float = 0.0,
) -> Tree:
    """build_heap's tree of budget 1 where depth 0 takes the base marginal (Domino's depths below prefix_len, the marg
    arm), from that depth's base logits [V'] alone: no Round, scorer or heap. The one pop is the first of the
    marginal's top `k` (the scorer's width: on ties, top-k's order decides, as in the heap); `ids` maps a column to
    its target id (a draft vocabulary); `stop` starts and admits it or leaves the root alone, as build_heap's.
    `chain`: prompt lookup's next tokens after the root, scored `log_accept`, as LookupScorer adds them."""
    if stop is not None:
        stop.start()
    lp, col = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(k, logits.shape[-1]))
    if chain:
        tokens = (col if ids is None else ids[col]).tolist()
        tokens, scores = with_chain_children(tokens, lp.tolist(), chain, log_accept)
        scores = torch.tensor(scores, dtype=torch.float32).tolist()  # the heap's float32 scores
        j = scores.index(max(scores))  # the first of equals, as the heap pops them
        token, score = tokens[j], scores[j]
    else:
        score = float(lp[0])
        token = int(col[0]) if ids is None else int(ids[col[0]])
    if stop is not None and not stop.admit(0, score):
        return Tree.chain([], root=root)
    return Tree.one_child(root, token, score)

"""A draft tree for one request, in the flat layout the verifier consumes.

Index 0 is the root (the committed token); nodes follow in selection order, so a parent always precedes its
children. A node at 0-based draft depth d has tree depth d + 1 and verify position past + d + 1.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # Long[N], tokens[0] = root
    parents: torch.Tensor  # Long[N], parents[0] = -1
    depths: torch.Tensor  # Long[N], depths[0] = 0
    scores: torch.Tensor  # float32[N], cumulative log-prob, scores[0] = 0
    mask: torch.Tensor  # Bool[N, N], row i = ancestors of i (root included) and i itself

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """Draft nodes, the root excluded."""
        return len(self) - 1

    def positions(self, past: int) -> torch.Tensor:
        return past + self.depths

    def packed_mask(self) -> torch.Tensor:
        """int32 [N, ceil(N/32)]: bit j % 32 of word j // 32 is mask[i, j]."""
        return pack_mask(self.mask)

    @classmethod
    def from_parents(cls, tokens, parents, scores=None) -> "Tree":
        """Derive depths and the ancestor mask; parents must precede their children."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parent_list = [int(p) for p in parents]
        n = len(parent_list)
        if tokens.shape != (n,):
            raise ValueError(f"tokens {tuple(tokens.shape)} and parents ({n},) differ in length")
        if n == 0 or parent_list[0] != -1:
            raise ValueError("index 0 must be the root, with parent -1")
        depths = [0] * n
        # the mask in numpy, one small tree a round: row copies there cost a tenth of torch's per-op overhead
        mask = np.zeros((n, n), dtype=bool)
        mask[0, 0] = True
        for i in range(1, n):
            p = parent_list[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")
            depths[i] = depths[p] + 1
            mask[i] = mask[p]
            mask[i, i] = True
        scores = torch.zeros(n) if scores is None else torch.as_tensor(scores, dtype=torch.float32)
        return cls(
            tokens,
            torch.tensor(parent_list, dtype=torch.long),
            torch.tensor(depths, dtype=torch.long),
            scores,
            torch.from_numpy(mask),
        )

    def within(self, max_depth: int) -> "Tree":
        """The nodes at tree depth <= max_depth (the root always), in their order: every kept node's ancestors are
        kept, so the parents re-index and the mask is the kept rows and columns."""
        if len(self) - 1 <= max_depth:  # n draft nodes reach depth n at most
            return self
        keep = torch.nonzero(self.depths <= max_depth)[:, 0]
        if len(keep) == len(self):
            return self
        index = torch.full((len(self),), -1, dtype=torch.long)
        index[keep] = torch.arange(len(keep))
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, index[parents.clamp(min=0)], parents)
        return Tree(self.tokens[keep], parents, self.depths[keep], self.scores[keep], self.mask[keep][:, keep])

    @classmethod
    def chain(cls, tokens_after_root, root: int = 0) -> "Tree":
        """A chain root -> t0 -> t1 -> ... (the dflash and domino methods), scores 0."""
        tokens = [root, *[int(t) for t in tokens_after_root]]
        if len(tokens) == 1:  # every AR step's tree
            return cls(torch.tensor(tokens, dtype=torch.long), *_ALONE)
        return cls.from_parents(tokens, list(range(-1, len(tokens) - 1)))

    @classmethod
    def one_child(cls, root: int, token: int, score: float) -> "Tree":
        """The root and one draft of cumulative log-prob `score` (a budget-1 tree)."""
        scores = torch.tensor([0.0, score], dtype=torch.float32)
        return cls(torch.tensor([root, token], dtype=torch.long), *_PAIR[:2], scores, _PAIR[2])


# The structure every root-alone tree and every root-and-one-child tree shares, made once: a decode step builds one
# such tree a round, after the target's step has evicted the host's caches, where each tensor made costs tens of
# microseconds. Trees are never written into.
_ALONE = (
    torch.tensor([-1]),
    torch.tensor([0]),
    torch.zeros(1, dtype=torch.float32),
    torch.ones(1, 1, dtype=torch.bool),
)
_PAIR = (torch.tensor([-1, 0]), torch.tensor([0, 1]), torch.tensor([[True, False], [True, True]]))


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., N] -> int32 [..., ceil(N/32)], bit j % 32 of word j // 32."""
    n = mask.shape[-1]
    words = (n + 31) // 32
    bits = torch.nn.functional.pad(mask.to(torch.int64), (0, words * 32 - n))
    bits = bits.reshape(*mask.shape[:-1], words, 32)
    packed = (bits << torch.arange(32, dtype=torch.int64, device=mask.device)).sum(-1)
    # packed is in [0, 2^32); map bit 31 to the int32 sign bit explicitly (two's complement)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_mask: int32 [..., ceil(n/32)] -> Bool [..., n]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64, device=packed.device)) & 1
    return bits.flatten(-2)[..., :n].bool()


def first_nodes(accepted) -> bool:
    """Whether accepted tree indices are the tree's first nodes, 0, 1, ..., n-1 (a chain's path: AR's root, a
    budget-1 tree's): their entries are a slice of what the verify computed, no gather needed."""
    return list(accepted) == list(range(len(accepted)))


def accept(tree: Tree, target_tokens) -> tuple[list[int], int]:
    """Longest path whose tokens the target reproduces; returns (accepted tree indices from 0, bonus token).

    target_tokens[i] (or target_tokens(i), a callable asked only for the nodes the walk reaches) is the target's
    choice after node i (argmax at T=0, a sample at T>0). Siblings carry distinct tokens; should padding repeat one,
    the earlier (real) node wins.
    """
    if callable(target_tokens):
        target = target_tokens
    else:
        listed = [int(t) for t in torch.as_tensor(target_tokens).tolist()]
        if len(listed) != len(tree):
            raise ValueError(f"target_tokens has {len(listed)} entries for a tree of {len(tree)}")
        target = listed.__getitem__
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)
    accepted = [0]
    while True:
        cur = accepted[-1]
        t = int(target(cur))
        nxt = next((c for c in children[cur] if tokens[c] == t), None)
        if nxt is None:
            return accepted, t
        accepted.append(nxt)

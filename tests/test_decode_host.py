"""A decode step's host work, written for a step that runs after the target's call has evicted the host's caches
(numpy where torch's per-op cost dominates, slices where a copy is not needed, trees of shared structure): each gives
exactly what the general torch form gives."""

import pytest
import torch
from test_tree_builders import make_round, make_scorer

from dtrt.runtime.backends.exported import ExportedBackend, pad_rows
from dtrt.runtime.backends.kv import TargetKV
from dtrt.runtime.sampling import chooser
from dtrt.tree import Tree, build_heap, first_nodes


def torch_pad_rows(ids, positions, mask, rows):
    """The general form (any device)."""
    n, extra = len(ids), rows - len(ids)
    padded = torch.zeros(rows, rows, dtype=torch.bool)
    padded[:n, :n] = mask
    padded[n:, n:] = torch.eye(extra, dtype=torch.bool)
    return torch.cat((ids, ids[-1:].repeat(extra))), torch.cat((positions, positions[-1:].repeat(extra))), padded


@pytest.mark.parametrize("n, rows", [(1, 2), (3, 4), (2, 5), (4, 4)])
def test_pad_rows_on_the_host_is_the_torch_form(n, rows):
    tree = build_heap(make_scorer("marginal", make_round(1, 4, seed=n), None, 3), n - 1, 4)
    args = (tree.tokens, tree.positions(17), tree.mask)
    got, want = pad_rows(*args, rows), torch_pad_rows(*args, rows)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_argmax_choices_are_torchs_first_of_equals():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 300), generator=g).float()  # many ties per row
    choose = chooser(logits)  # no draws: T=0
    assert [choose(i) for i in range(6)] == logits.argmax(-1).tolist()


def test_trees_of_shared_structure_are_those_from_parents():
    for got, want in (
        (Tree.chain([], root=9), Tree.from_parents([9], [-1])),
        (Tree.one_child(9, 4, -0.25), Tree.from_parents([9, 4], [-1, 0], [0.0, -0.25])),
    ):
        for field in ("tokens", "parents", "depths", "scores", "mask"):
            x, y = getattr(got, field), getattr(want, field)
            assert x.dtype == y.dtype and torch.equal(x, y)


class Commit:
    """ExportedBackend.commit over a bare cache: what a target call's new K/V leave in it."""

    def __init__(self):
        self.cache = TargetKV(3, 2, 4, 32, torch.float32)
        self.device, self.recurrent = torch.device("cpu"), False

    def __call__(self, new_k, new_v, accepted):
        self._new_kv = (new_k, new_v)
        ExportedBackend.commit(self, accepted)
        return self.cache.k[:, :, : self.cache.length].clone(), self.cache.v[:, :, : self.cache.length].clone()


@pytest.mark.parametrize("accepted", [[0], [0, 1], [0, 1, 2], [0, 2], [0, 1, 3]])
def test_commit_keeps_the_accepted_positions(accepted):
    """A chain's path is a slice of the call's new K/V, any other path is gathered: both keep exactly the accepted."""
    g = torch.Generator().manual_seed(len(accepted))
    past_k, past_v = (torch.randn(3, 2, 5, 4, generator=g) for _ in "kv")
    new_k, new_v = (torch.randn(3, 2, 4, 4, generator=g) for _ in "kv")
    commit = Commit()
    commit(past_k, past_v, list(range(5)))
    k, v = commit(new_k, new_v, accepted)
    idx = torch.tensor(accepted)
    assert torch.equal(k, torch.cat((past_k, new_k[:, :, idx]), 2))
    assert torch.equal(v, torch.cat((past_v, new_v[:, :, idx]), 2))


def test_first_nodes_are_a_chains_path():
    assert first_nodes([0]) and first_nodes([0, 1, 2]) and first_nodes(torch.tensor([0, 1]))
    assert not first_nodes([0, 2]) and not first_nodes([0, 1, 3])

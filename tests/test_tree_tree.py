import pytest
import torch

from dtrt.tree import Tree, accept, pack_mask, unpack_mask

#      0 (root 5)
#     /         \
#   1 (7)      2 (8)
#   /   \
# 3 (9)  4 (3)
#  |
# 5 (4)
TOKENS = [5, 7, 8, 9, 3, 4]
PARENTS = [-1, 0, 0, 1, 1, 3]


def example() -> Tree:
    return Tree.from_parents(TOKENS, PARENTS, [0.0, -0.1, -0.5, -0.3, -0.9, -0.7])


def python_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    rows = []
    for words in packed.tolist():
        bits = []
        for w in words:
            w &= 0xFFFFFFFF
            bits.extend(bool(w >> j & 1) for j in range(32))
        rows.append(bits[:n])
    return torch.tensor(rows, dtype=torch.bool).reshape(packed.shape[0], n)


def test_from_parents_derives_depths_and_mask():
    t = example()
    assert len(t) == 6 and t.num_nodes == 5
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.positions(100).tolist() == [100, 101, 101, 102, 102, 103]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 1, 3, 5]]):
        expected[i, ancestors] = True
    assert torch.equal(t.mask, expected)
    assert t.scores.dtype == torch.float32 and t.scores[4].item() == pytest.approx(-0.9)


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 2, 0], [-1, -1]])
def test_from_parents_rejects_bad_order(parents):
    with pytest.raises(ValueError):
        Tree.from_parents(list(range(len(parents))), parents)


def test_chain():
    t = Tree.chain([11, 12, 13], root=10)
    assert t.tokens.tolist() == [10, 11, 12, 13]
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(t.mask, torch.ones(4, 4, dtype=torch.bool).tril())


def test_packed_mask_bit_layout():
    mask = torch.zeros(2, 33, dtype=torch.bool)
    mask[0, [0, 31, 32]] = True
    mask[1, [1, 30]] = True
    packed = pack_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (2, 2)
    assert packed.tolist() == [[1 - 2**31, 1], [2 + 2**30, 0]]


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 64, 65, 100])
def test_packed_mask_round_trip(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, n, generator=g) < 0.5
    mask[:, -1] = True  # exercise the highest bit of the last word
    packed = pack_mask(mask)
    assert packed.shape == (n, (n + 31) // 32)
    assert torch.equal(python_unpack(packed, n), mask)
    assert torch.equal(unpack_mask(packed, n), mask)


def test_accept_full_partial_zero():
    t = example()
    # full: 0 -> 1 -> 3 -> 5, bonus after the leaf
    assert accept(t, torch.tensor([7, 9, 0, 4, 0, 42])) == ([0, 1, 3, 5], 42)
    # partial: the second level matches node 4 (token 3), which has no children
    assert accept(t, [7, 3, 0, 0, 0, 0]) == ([0, 1, 4], 0)
    assert accept(t, [8, 0, 11, 0, 0, 0]) == ([0, 2], 11)
    # zero: no child of the root matches
    assert accept(t, [99, 9, 0, 4, 0, 0]) == ([0], 99)


def test_accept_prefers_real_node_over_padding():
    # two padding leaves under the root repeat the mask token 88; a real child also carries 88
    t = Tree.from_parents([1, 88, 5, 88, 88], [-1, 0, 1, 0, 0])
    assert accept(t, [88, 5, 7, 0, 0]) == ([0, 1, 2], 7)


def test_accept_checks_length():
    with pytest.raises(ValueError):
        accept(example(), [1, 2, 3])

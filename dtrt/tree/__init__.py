"""Draft trees: scorers, the heap and frontier DominoTree builders, DDTree and CaDDTree, and acceptance."""

from dtrt.tree.caddtree import CostAwareStop, CostCurve
from dtrt.tree.ddtree import build_ddtree
from dtrt.tree.frontier import FrontierTrees, build_frontier
from dtrt.tree.heap import best_marginal_child, build_heap
from dtrt.tree.scorer import MarginalScorer, Round, Scorer, TableScorer
from dtrt.tree.tree import Tree, accept, first_nodes, pack_mask, unpack_mask

__all__ = [
    "CostAwareStop",
    "CostCurve",
    "FrontierTrees",
    "MarginalScorer",
    "Round",
    "Scorer",
    "TableScorer",
    "Tree",
    "accept",
    "first_nodes",
    "build_ddtree",
    "build_frontier",
    "best_marginal_child",
    "build_heap",
    "pack_mask",
    "unpack_mask",
]

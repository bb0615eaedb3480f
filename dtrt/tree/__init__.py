"""Draft trees: scorers, the heap and frontier DominoTree builders, DDTree and CaDDTree, and acceptance."""

from dtrt.tree.caddtree import CostAwareStop, CostCurve, build_caddtree
from dtrt.tree.ddtree import build_ddtree
from dtrt.tree.frontier import FrontierTrees, build_frontier
from dtrt.tree.heap import build_heap
from dtrt.tree.scorer import CondStaticScorer, DominoScorer, MarginalScorer, Round, TableScorer
from dtrt.tree.tree import Tree, accept, pack_mask, unpack_mask

__all__ = [
    "CondStaticScorer",
    "CostAwareStop",
    "CostCurve",
    "DominoScorer",
    "FrontierTrees",
    "MarginalScorer",
    "Round",
    "TableScorer",
    "Tree",
    "accept",
    "build_caddtree",
    "build_ddtree",
    "build_frontier",
    "build_heap",
    "pack_mask",
    "unpack_mask",
]

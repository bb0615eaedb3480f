"""Domino's scorers for the builders in dtrt.tree, in one package: over the PyTorch head (domino.py: per path,
condstatic) and over the exported scorer stages (stages.py, run through a backend's StageRunner)."""

from dtrt.scoring.domino import CondStaticScorer, DominoScorer, domino_chain, greedy_chain_tables
from dtrt.scoring.stages import StageDominoScorer

__all__ = ["CondStaticScorer", "DominoScorer", "StageDominoScorer", "domino_chain", "greedy_chain_tables"]

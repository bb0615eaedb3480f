"""Scorers that compute with a model's weights (Domino's GRU head), for the builders in dtrt.tree."""

from dtrt.scoring.domino import CondStaticScorer, DominoScorer, domino_chain, greedy_chain_tables

__all__ = ["CondStaticScorer", "DominoScorer", "domino_chain", "greedy_chain_tables"]

"""Checkpoints that ship with dtrt (the drafters trained for the embedded default target)."""

"""`python -m dtrt.cli` (torchrun's entry point for `train-drafter` on several processes)."""

from dtrt.cli import main

main()

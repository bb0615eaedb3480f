"""dtrt: DominoTree speculative decoding, from the PyTorch reference to deployable artifacts."""

__version__ = "0.1.0"

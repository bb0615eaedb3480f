"""`dtrt parity`: every exported stage under ONNX Runtime against its PyTorch reference on the same inputs, random
ones and ones captured from real generations (which is why it sits above the runtime)."""

from dtrt.parity.check import Report, Tolerance, run_parity

__all__ = ["Report", "Tolerance", "run_parity"]

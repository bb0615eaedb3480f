"""The backends behind the decode loop, one module each: torch (the PyTorch reference), onnxruntime and tensorrt
(both ExportedBackend over a StageRunner, exported.py). base.py is the contract every one of them implements."""

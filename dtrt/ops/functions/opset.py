"""The `dtrt` ONNX opset and the function bodies registered in it, by op type."""

import onnxscript

from dtrt.plugins import DOMAIN, VERSION

OPSET = onnxscript.values.Opset(DOMAIN, VERSION)
FUNCTIONS: dict[str, onnxscript.OnnxFunction] = {}


def register_function(fn: onnxscript.OnnxFunction) -> onnxscript.OnnxFunction:
    FUNCTIONS[fn.name] = fn
    return fn

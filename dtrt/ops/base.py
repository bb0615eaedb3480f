"""Plumbing shared by the dtrt ops: emitting a `dtrt` node during export and collecting the function bodies
(dtrt.ops.functions, imported here only when an export asks for them)."""

import importlib

import torch

from dtrt.plugins import DOMAIN, VERSION


def onnx_functions(names) -> list:
    """FunctionProtos for the dtrt op types `names` and the dtrt functions their bodies call, to attach to an
    exported model."""
    functions = importlib.import_module("dtrt.ops.functions").FUNCTIONS
    found, todo = {}, list(names)
    while todo:
        name = todo.pop()
        if name not in found:
            found[name] = functions[name].to_function_proto()
            todo += [n.op_type for n in found[name].node if n.domain == DOMAIN]
    protos = [found[n] for n in sorted(found)]
    for proto in protos:
        del proto.value_info[:]  # onnxscript records every input as a scalar FLOAT; shapes come from the graph
    return protos


def emit(name: str, inputs: tuple, dtypes: tuple, shapes: tuple, attrs: dict | None = None):
    """A `dtrt::<name>` node in the exported graph (one output, or a tuple when several dtypes are given)."""
    if len(dtypes) == 1:
        return torch.onnx.ops.symbolic(
            f"{DOMAIN}::{name}", inputs, attrs or {}, dtype=dtypes[0], shape=shapes[0], version=VERSION
        )
    return torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{name}", inputs, attrs or {}, dtypes=dtypes, shapes=shapes, version=VERSION
    )

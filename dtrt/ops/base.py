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
        rename = canonical_loops(proto, {})
        proto.output[:] = [rename.get(n, n) for n in proto.output]
    return protos


def canonical_loops(graph, rename: dict) -> dict:
    """Each ONNX Loop of a function (or graph) `graph` in one order that does not depend on the process: onnxscript
    orders a Loop's carried variables as a Python set of their names iterates, which changes with the string hash
    seed from process to process, and numbers the body's inputs and the Loop's outputs in that order, so an export
    made twice differed. The carried variables go in the order of their names, and the body's inputs and the Loop's
    outputs take their numbers in that order (onnxscript numbers every name once: `cur_16`, `rows_17` whichever it
    wrote first); `rename` (old name -> new) grows as it goes and is applied to every later use, subgraphs included.
    Returns `rename`."""
    for node in graph.node:
        node.input[:] = [rename.get(n, n) for n in node.input]
        if node.op_type == "Loop" and node.domain in ("", "ai.onnx"):
            body = next(a.g for a in node.attribute if a.name == "body")
            k = len(node.input) - 2
            order = sorted(range(k), key=lambda i: _split(body.input[2 + i].name))
            _permute(node.input, 2, order)
            _permute(body.input, 2, order)
            _permute(body.output, 1, order)
            _permute(node.output, 0, order)
            for item, name in zip(body.input[2:], _renumbered([v.name for v in body.input[2:]], rename)):
                item.name = name
            node.output[:k] = _renumbered(list(node.output[:k]), rename)
        for attr in node.attribute:
            if attr.HasField("g"):
                canonical_loops(attr.g, rename)
    for out in getattr(graph, "output", ()):
        if hasattr(out, "name"):  # a graph's outputs (a function's are names: onnx_functions renames them)
            out.name = rename.get(out.name, out.name)
    return rename


def _split(name: str) -> tuple[str, int | None]:
    """(`cur`, 16) for `cur_16`; (name, None) for a name onnxscript did not number."""
    base, sep, num = name.rpartition("_")
    return (base, int(num)) if sep and num.isdigit() else (name, None)


def _renumbered(names: list[str], rename: dict) -> list[str]:
    """`names` with their numbers (the numbered ones') given out in ascending order by position; `rename` records
    each change."""
    split = [_split(n) for n in names]
    numbers = iter(sorted(num for _, num in split if num is not None))
    new = [name if num is None else f"{base}_{next(numbers)}" for name, (base, num) in zip(names, split)]
    rename.update((a, b) for a, b in zip(names, new) if a != b)
    return new


def _permute(field, start: int, order: list[int]):
    """The repeated `field`'s items from `start` on put in `order` (strings or messages)."""
    items = list(field)[start:]
    if items and not isinstance(items[0], str):
        items = [type(x).FromString(x.SerializeToString()) for x in items]
        del field[start:]
        field.extend(items[i] for i in order)
    else:
        field[start:] = [items[i] for i in order]


def emit(name: str, inputs: tuple, dtypes: tuple, shapes: tuple, attrs: dict | None = None):
    """A `dtrt::<name>` node in the exported graph (one output, or a tuple when several dtypes are given)."""
    if len(dtypes) == 1:
        return torch.onnx.ops.symbolic(
            f"{DOMAIN}::{name}", inputs, attrs or {}, dtype=dtypes[0], shape=shapes[0], version=VERSION
        )
    return torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{name}", inputs, attrs or {}, dtypes=dtypes, shapes=shapes, version=VERSION
    )

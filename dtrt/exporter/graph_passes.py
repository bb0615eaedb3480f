"""Rewrites of an exported graph that the torch exporter cannot express.

slice_past: the target reads its past from the runtime's whole cache buffer, past_k/past_v [L, KVH, C, HD] with
the past its first P positions. Exported as written, that is one Slice of every layer's first P positions (a copy
of the whole past) and then a Gather per layer (a second copy). Each Gather becomes one Slice over both axes
(layer l, positions 0..P) and a Squeeze, so every call copies each layer's past once, as it did when the runtime
handed in a dense past, and the runtime no longer re-spaces its cache on every append.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

PAST_INPUTS = ("past_k", "past_v")


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Every initializer held in the model file and every Constant node's value, by name."""
    values = {  # the weights (external data) are never an index or a slice bound
        t.name: numpy_helper.to_array(t) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
    }
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def slice_past(model: onnx.ModelProto) -> int:
    """Rewrite Slice(past, positions 0..P) -> Gather(layer l) into Slice(past, [l, 0], [l + 1, P], axes [0, 2])
    -> Squeeze(0), in place; return how many Gathers were rewritten. A Slice of the past that does not match
    this pattern (or a non-constant layer index) is left as it is."""
    graph = model.graph
    consts = constant_values(graph)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> what takes its place ([] drops it)
    for node in list(graph.node):
        if node.op_type != "Slice" or node.input[0] not in PAST_INPUTS or len(node.input) < 4:
            continue
        starts, axes = consts.get(node.input[1]), consts.get(node.input[3])
        steps = consts.get(node.input[4]) if len(node.input) > 4 and node.input[4] else np.ones(1, np.int64)
        if starts is None or axes is None or starts.tolist() != [0] or axes.tolist() != [2] or steps.tolist() != [1]:
            continue
        users = consumers.get(node.output[0], [])
        gathers = [
            g
            for g in users
            if g.op_type == "Gather"
            and g.input[0] == node.output[0]
            and helper.get_node_attr_value(g, "axis") == 0
            and consts.get(g.input[1]) is not None
            and consts[g.input[1]].ndim == 0
        ]
        if not gathers or len(gathers) != len(users):
            continue
        past, ends, tag = node.input[0], node.input[2], node.output[0]
        constant(graph, f"{tag}_layer_axes", [0, 2])
        constant(graph, f"{tag}_squeeze_axes", [0])
        for g in gathers:
            layer, stem = int(consts[g.input[1]]), f"{g.output[0]}_past"
            constant(graph, f"{stem}_starts", [layer, 0])
            constant(graph, f"{stem}_end", [layer + 1])
            replaced[id(g)] = [
                helper.make_node("Concat", [f"{stem}_end", ends], [f"{stem}_ends"], axis=0, name=f"{stem}_ends"),
                helper.make_node(
                    "Slice", [past, f"{stem}_starts", f"{stem}_ends", f"{tag}_layer_axes"], [f"{stem}_4d"], name=stem
                ),
                helper.make_node("Squeeze", [f"{stem}_4d", f"{tag}_squeeze_axes"], [g.output[0]], name=f"{stem}_2"),
            ]
        replaced[id(node)] = []
    if replaced:  # each Gather's replacement takes its place in the (topological) order
        nodes = [new for node in graph.node for new in replaced.get(id(node), [node])]
        del graph.node[:]
        graph.node.extend(nodes)
    return sum(len(r) > 0 for r in replaced.values())


def constant(graph: onnx.GraphProto, name: str, values: list[int]):
    graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))


def live_nodes(nodes: list, outputs: set[str]) -> list:
    """The nodes that a graph output depends on, in their order."""
    needed, keep = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1]

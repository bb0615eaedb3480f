"""A quantized target's RoPE as ONNX's RotaryEmbedding (opset 23): one node per rotation where the torch export
writes four (dtrt.models.layers.apply_rope: x * cos + Gather(x, half turn) * signed sin, then the Add).

At SmolLM2's size a node costs more than its arithmetic. The rotation reads the heads as [1, N, heads * head_dim]
(the op's 3-D form, `num_heads`) with the halves of the call's cos and sin (`interleaved` 0: the rotate-half
convention): the projection's output itself where the heads are its reshape (Llama), else the heads as they are
(after Qwen3's per-head norms; their shape from the graph's value_info). The same arithmetic up to the kernel's
fused multiply-adds. A rotation that does not match the pattern exactly is left as it is.
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dtrt.exporter.graph_passes import constant, constant_values, live_nodes

ROTARY_OPSET = 23


def rotary_nodes(graph: onnx.GraphProto, base_dir: Path | None = None) -> tuple[list, int]:
    """(the graph's nodes with every matching rotation as one RotaryEmbedding, how many were rewritten); the
    graph's initializers gain the slice bounds of the cos/sin halves and the reshapes' shapes. `base_dir`: where
    the model's external data lies (the half-turn index may be stored there)."""
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consts = constant_values(graph)
    for t in graph.initializer:  # small integer tensors held outside the model file: read them too
        if t.name not in consts and t.data_type == onnx.TensorProto.INT64 and len(t.dims) == 1 and base_dir:
            consts[t.name] = numpy_helper.to_array(t, str(base_dir))
    shapes = {v.name: v.type.tensor_type.shape for v in graph.value_info}
    names = {i.name for i in graph.initializer}

    def init(name: str, values: list[int]) -> str:
        if name not in names:
            constant(graph, name, values)
            names.add(name)
        return name

    halves: dict[tuple[str, str], tuple[str, str]] = {}  # (cos, signed sin) -> their halves
    replaced: dict[int, list] = {}
    for add in nodes:
        match = _rotation(add, producer, consts, shapes)
        if match is None:
            continue
        rows, cos, sin, heads, hd = match
        new = []
        if (cos, sin) not in halves:
            stem = f"rope{len(halves) or ''}"
            zero, half, end, axis = (init(f"{stem}.{n}", [v]) for n, v in (("zero", 0), ("half", hd // 2),
                                                                           ("end", hd), ("axis", -1)))  # fmt: skip
            halves[cos, sin] = (f"{stem}.cos", f"{stem}.sin")
            # rotate-half: cat(c, c) and cat(-s, s), so the cos's first half and the sin's second
            new += [
                helper.make_node("Slice", [cos, zero, half, axis], [f"{stem}.cos"]),
                helper.make_node("Slice", [sin, half, end, axis], [f"{stem}.sin"]),
            ]
        out = add.output[0]
        shape = init(f"rope.rows_{heads}x{hd}", [1, -1, heads * hd])  # the op's 3-D form: [1, N, heads * hd]
        new.append(helper.make_node("Reshape", [rows, shape], [f"{out}.rows"]))
        new += [
            helper.make_node(
                "RotaryEmbedding", [f"{out}.rows", *halves[cos, sin]], [f"{out}.rotated"], num_heads=heads
            ),
            helper.make_node(
                "Reshape", [f"{out}.rotated", init(f"rope.heads_{heads}x{hd}", [-1, heads, hd])], [f"{out}.heads"]
            ),  # fmt: skip
            helper.make_node("Transpose", [f"{out}.heads"], [out], perm=[1, 0, 2]),
        ]
        replaced[id(add)] = new
    rewritten = [new for node in nodes for new in replaced.get(id(node), [node])]
    return live_nodes(rewritten, {o.name for o in graph.output}), len(replaced)


def _rotation(add, producer: dict, consts: dict, shapes: dict):
    """Add(Mul(x, cos), Mul(Gather(x, half turn, axis -1), signed sin)) with x = Transpose(y [N, heads, hd],
    perm [1, 0, 2]) and cos/sin [1, N, hd]: (the rows to rotate, cos, signed sin, heads, hd), else None."""
    if add.op_type != "Add":
        return None
    muls = [producer.get(i) for i in add.input]
    if not all(m is not None and m.op_type == "Mul" for m in muls):
        return None
    turned = [(m, producer.get(m.input[0])) for m in muls]
    turned = [(m, g) for m, g in turned if g is not None and g.op_type == "Gather"]
    if len(turned) != 1:
        return None
    (sin_mul, gather), cos_mul = turned[0], next(m for m in muls if m is not turned[0][0])
    x = gather.input[0]
    transpose = producer.get(x)
    if cos_mul.input[0] != x or transpose is None or transpose.op_type != "Transpose":
        return None
    perm = next((list(helper.get_attribute_value(a)) for a in transpose.attribute if a.name == "perm"), None)
    tables = [producer.get(cos_mul.input[1]), producer.get(sin_mul.input[1])]
    if perm != [1, 0, 2] or not all(t is not None and t.op_type == "Unsqueeze" for t in tables):
        return None  # the op's 3-D table form is [1, N, hd]
    y = transpose.input[0]
    dims = _static_tail(y, producer, consts, shapes)
    if dims is None:
        return None
    heads, hd = dims
    order = consts.get(gather.input[1])
    axis = next((helper.get_attribute_value(a) for a in gather.attribute if a.name == "axis"), 0)
    half_turn = np.concatenate([np.arange(hd // 2, hd), np.arange(hd // 2)])
    if axis not in (-1, 2) or order is None or order.shape != half_turn.shape or not (order == half_turn).all():
        return None
    reshape = producer.get(y)
    if reshape is not None and reshape.op_type == "Reshape" and reshape.input[1] in consts:
        y = reshape.input[0]  # the projection itself: its reshape into heads is then left unread
    return y, cos_mul.input[1], sin_mul.input[1], heads, hd


def _static_tail(y: str, producer: dict, consts: dict, shapes: dict) -> tuple[int, int] | None:
    """(heads, hd) of y [N, heads, hd]: from the constant shape of the Reshape that makes it, else its shape."""
    reshape = producer.get(y)
    if reshape is not None and reshape.op_type == "Reshape" and reshape.input[1] in consts:
        shape = consts[reshape.input[1]]
        if shape.ndim == 1 and len(shape) == 3 and (shape[1:] > 0).all() and shape[0] != 0:
            return int(shape[1]), int(shape[2])
    if y in shapes and len(shapes[y].dim) == 3:
        tail = [d.dim_value if d.HasField("dim_value") else 0 for d in shapes[y].dim[1:]]
        if all(d > 0 for d in tail):
            return tail[0], tail[1]
    return None

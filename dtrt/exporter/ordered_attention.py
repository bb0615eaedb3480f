"""A quantized target's attention as the ordered attention (dtrt.ops.tree_attention): tree rows equal plain
decoding's rows bit for bit.

The torch export writes each layer's attention as TreeAttention(q, Concat(past K, new K), Concat(past V, new V),
mask), the past K and V read from the caches with the Slices that dtrt.exporter.graph_passes.slice_past makes. Here
every layer becomes TreeAttentionPlanned over the parts themselves: the whole K and V caches with the layer's index,
and the new keys and values, so no layer copies its past (a slice or a join of the past is a copy of it). The
mask-only part is computed once per call by one TreeAttentionOrderPlan per distinct mask, before the first layer
that reads it (a target's layers share one). What only the slices and joins read is dropped.

A cache narrower than fp32 keeps the keys' join: ONNX Runtime's CPU provider computes an fp16 layer in fp32 and
drops the round trip through fp16 where no fp16 kernel sits between, so the new keys would score at fp32 while the
same keys read back from the cache score at fp16, and a tree's rows would no longer be plain decoding's. The join
(an fp16 Concat) rounds them; the layer then scores the joined tensor's new rows as its new keys.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dtrt.exporter.graph_passes import constant, live_nodes
from dtrt.ops import DOMAIN
from dtrt.ops.tree_attention import ORDER_PLAN


def ordered_attention_nodes(graph: onnx.GraphProto) -> list:
    """The graph's nodes with every TreeAttention rewritten (its initializers gain each layer's cache offset and the
    attention's scale)."""
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    att = [n for n in nodes if n.domain == DOMAIN and n.op_type == "TreeAttention"]
    if not att:
        return nodes
    first = {}  # mask -> the first attention node reading it
    for n in att:
        first.setdefault(n.input[3], n)
    plans = {mask: [f"attention_plan{i or ''}.{name}" for name in ORDER_PLAN] for i, mask in enumerate(first)}
    cache = next(i.type.tensor_type for i in graph.input if i.name == "past_v")
    cache_type, hd = cache.elem_type, cache.shape.dim[-1].dim_value
    if hd <= 0:
        raise ValueError("past_v: its head dimension is not static")
    scale = float(np.float32(1) / np.sqrt(np.float32(hd)))  # a constant: ONNX Runtime folds it into the products
    graph.initializer.append(helper.make_tensor("attention.scale", cache_type, [], [scale]))
    narrow = cache_type != onnx.TensorProto.FLOAT
    if narrow:  # the joined keys' new rows: from the past's length to the end
        constant(graph, "attention.key_end", [np.iinfo(np.int64).max])
        constant(graph, "attention.key_axis", [1])
    out = []
    for n in nodes:
        if n.domain != DOMAIN or n.op_type != "TreeAttention":
            out.append(n)
            continue
        q, k, v, mask = n.input
        k_past, k_new = _joined(producer, k, n)
        v_past, v_new = _joined(producer, v, n)
        k_cache, k_layer = _cache_slice(producer, inits, k_past, n)
        v_cache, layer = _cache_slice(producer, inits, v_past, n)
        if k_layer != layer:
            raise ValueError(f"{n.name}: its keys are sliced from layer {k_layer} and its values from layer {layer}")
        layer_name = f"{n.name or n.output[0]}.layer"
        constant(graph, layer_name, [layer, 0])
        plan = plans[mask]
        if first[mask] is n:
            name = plan[0].split(".")[0]
            out.append(helper.make_node("TreeAttentionOrderPlan", [q, k_cache, mask], plan, name, domain=DOMAIN))
        if narrow:
            start, rounded = f"{k_new}.start", f"{k_new}.rounded"
            out.append(helper.make_node("Shape", [k_past], [start], start, start=1, end=2))
            args = [k, start, "attention.key_end", "attention.key_axis"]
            out.append(helper.make_node("Slice", args, [rounded], rounded))
            k_new = rounded
        inputs = [q, k_cache, k_new, v_cache, layer_name, v_new, "attention.scale", *plan]
        out.append(helper.make_node("TreeAttentionPlanned", inputs, list(n.output), n.name, domain=DOMAIN))
    return live_nodes(out, {o.name for o in graph.output})


def _joined(producer: dict, name: str, att) -> tuple[str, str]:
    """(past, new) of the Concat that joins a layer's past K or V with the new tokens'."""
    node = producer.get(name)
    if node is None or node.op_type != "Concat" or len(node.input) != 2:
        raise ValueError(f"{att.name}: its keys/values {name!r} are not a Concat of the past and the new tokens")
    return node.input[0], node.input[1]


def _cache_slice(producer: dict, inits: dict, past: str, att) -> tuple[str, int]:
    """(the cache input, the layer) that a layer's past K or V is sliced from: Squeeze(Slice(cache, [l, 0], ...))."""
    squeeze = producer.get(past)
    sliced = producer.get(squeeze.input[0]) if squeeze is not None and squeeze.op_type == "Squeeze" else None
    starts = inits.get(sliced.input[1]) if sliced is not None and sliced.op_type == "Slice" else None
    if starts is None:
        raise ValueError(f"{att.name}: its past {past!r} is not a slice of the cache (see slice_past)")
    return sliced.input[0], int(numpy_helper.to_array(starts)[0])

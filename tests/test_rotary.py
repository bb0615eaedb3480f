"""A quantized target's rotations as ONNX RotaryEmbedding (dtrt.exporter.rotary): the rewritten graph computes what
the torch model's rotation computes (dtrt.models.layers.apply_rope), for heads straight from a projection (Llama)
and for heads after a per-head norm (Qwen3), and a graph that only looks alike is left as it is."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from dtrt.exporter.rotary import ROTARY_OPSET, rotary_nodes
from dtrt.models.layers import apply_rope, rope_cos_sin
from dtrt.runtime.backends.onnxruntime import cpu_session

HEADS, HD = 3, 8


def rotation_graph(*, normed: bool, turn: list[int]) -> onnx.ModelProto:
    """proj [N, heads * hd] -> heads [N, heads, hd] (-> a per-head scale) -> [heads, N, hd] -> x * cos + Gather(x,
    turn) * signed sin, as the torch export writes it; cos and signed sin come in as [N, hd]."""
    inits = [
        numpy_helper.from_array(np.array([-1, HEADS, HD], np.int64), "shape"),
        numpy_helper.from_array(np.array(turn, np.int64), "turn"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.linspace(0.5, 1.5, HD).astype(np.float32), "norm_weight"),
    ]
    nodes = [helper.make_node("Reshape", ["proj", "shape"], ["heads"])]
    if normed:
        nodes.append(helper.make_node("Mul", ["heads", "norm_weight"], ["normed"]))
    nodes += [
        helper.make_node("Transpose", ["normed" if normed else "heads"], ["x"], perm=[1, 0, 2]),
        helper.make_node("Unsqueeze", ["cos", "axis0"], ["cos3"]),
        helper.make_node("Unsqueeze", ["sin", "axis0"], ["sin3"]),
        helper.make_node("Mul", ["x", "cos3"], ["xc"]),
        helper.make_node("Gather", ["x", "turn"], ["xt"], axis=-1),
        helper.make_node("Mul", ["xt", "sin3"], ["xs"]),
        helper.make_node("Add", ["xc", "xs"], ["out"]),
    ]
    inputs = [
        helper.make_tensor_value_info("proj", TensorProto.FLOAT, ["N", HEADS * HD]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["N", HD]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["N", HD]),
    ]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [HEADS, "N", HD])
    known = [helper.make_tensor_value_info("normed", TensorProto.FLOAT, ["N", HEADS, HD])] if normed else []
    graph = helper.make_graph(nodes, "rope", inputs, [out], inits, value_info=known)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", ROTARY_OPSET)])


def run(model: onnx.ModelProto, feeds: dict, path) -> np.ndarray:
    onnx.save_model(model, str(path))
    return cpu_session(path, threads=1).run(None, feeds)[0]


def rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes, n = rotary_nodes(out.graph)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    onnx.checker.check_model(out)
    return out, n


@pytest.mark.parametrize("normed", [False, True], ids=["projection", "normed-heads"])
def test_rotations_become_one_node_with_the_models_arithmetic(normed, tmp_path):
    turn = list(range(HD // 2, HD)) + list(range(HD // 2))
    model = rotation_graph(normed=normed, turn=turn)
    rotated, n = rewrite(model)
    ops = [node.op_type for node in rotated.graph.node]
    assert n == 1 and ops.count("RotaryEmbedding") == 1 and "Gather" not in ops
    positions = torch.arange(37, 42)
    cos, sin = rope_cos_sin(positions, HD, 10000.0, torch.float32)
    sign = torch.cat((-torch.ones(HD // 2), torch.ones(HD // 2)))
    proj = torch.randn(len(positions), HEADS * HD, generator=torch.Generator().manual_seed(0))
    feeds = {"proj": proj.numpy(), "cos": cos.numpy(), "sin": (sin * sign).numpy()}
    heads = proj.unflatten(-1, (HEADS, HD))
    if normed:
        heads = heads * torch.linspace(0.5, 1.5, HD)
    want = apply_rope(heads.transpose(0, 1), cos, sin).numpy()  # the torch model's rotation
    np.testing.assert_allclose(run(model, feeds, tmp_path / "torch.onnx"), want, rtol=0, atol=1e-6)
    # the rewritten graph: a fused multiply-add apart
    np.testing.assert_allclose(run(rotated, feeds, tmp_path / "rotary.onnx"), want, rtol=0, atol=1e-6)


def test_what_only_looks_like_a_rotation_is_left_alone():
    other = list(range(HD))[::-1]  # a Gather by another index: not the half turn
    model = rotation_graph(normed=False, turn=other)
    same, n = rewrite(model)
    assert n == 0 and [x.op_type for x in same.graph.node] == [x.op_type for x in model.graph.node]

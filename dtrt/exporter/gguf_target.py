"""`dtrt export --quant gguf|gguf-a8`: the target stage's linear layers computed from the 4- or 8-bit blocks of the
GGUF file its checkpoint was converted from, as the file holds them (dtrt.models.gguf_blocks), not quantized again:

    gguf      dtrt::BlockMatMul[Min](x, codes, scale[, min])   fp32 activations and sums: dtrt's kernel on ONNX
              Runtime's CPU provider (dtrt.runtime.backends.ort_ops), the function body elsewhere. Every row is
              summed in one order whatever the call's rows: with the ordered attention, a tree's rows are plain
              decoding's bit for bit, and a call needs no padding (min_rows 1).
    gguf-a8   com.microsoft::MatMulNBits(x, codes, scale, zero point), accuracy level 4 (activations quantized to
              int8 per block, as llama.cpp's kernels do), plus blocksum(x) · minᵀ where the format has mins (Q4_1,
              Q5_1, Q2_K, Q4_K, Q5_K: w = d·q + m is exactly d·(q - 0) and a min term); calls of at least two
              rows, as the int8 and int4 targets' (MatMulNBits' one-row kernel is another).

Both run the ordered attention of the int8/int4 targets (dtrt.exporter.ordered_attention).

The checkpoint's fp32 weight of each product must be its blocks dequantized, bit for bit (it is, for a checkpoint
dtrt converted): so the export computes what the checkpoint holds and the fp32 checkpoint is its reference. Products
of one activation (q/k/v, gate/up) whose blocks have one layout are merged, as the int8/int4 targets' are.
"""

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from dtrt.errors import DtrtError
from dtrt.exporter.target_quant import (
    DATA_SUFFIX,
    DataWriter,
    finish_graph,
    products_by_input,
    read_initializer,
    set_nodes,
)
from dtrt.models.blocks import BlockWeight, block_layout, codes_uint8, dequantize, pack_blocks
from dtrt.models.quant_spec import GgufQuant
from dtrt.ops import DOMAIN

MS_DOMAIN = "com.microsoft"
A8_ACCURACY = 4  # MatMulNBits: activations quantized to int8 per block


def cat_blocks(ws: list[BlockWeight]) -> BlockWeight:
    """Weights of one layout side by side along the output features."""
    first = ws[0]
    return BlockWeight(
        kind=first.kind,
        q=torch.cat([w.q for w in ws]),
        scale=torch.cat([w.scale for w in ws]),
        min=None if first.min is None else torch.cat([w.min for w in ws]),
        zero=first.zero,
        block=first.block,
    )


def export_gguf_target(path: Path, spec: GgufQuant, blocks: dict, weights: list[tuple[str, ...]], log=None):
    """Rewrite the target stage at `path` so that every linear product whose weight (one tuple of names per weight,
    as the graph may call it) has blocks in `blocks` (checkpoint name -> BlockWeight; a graph name is "target." +
    the checkpoint's) runs on them; returns (weights kept as blocks, products). Weights without blocks (the file's
    F32/F16 ones) stay fp32 products."""
    path = Path(path)
    root = path.parent
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    by_graph_name = {}
    for group in weights:
        found = [blocks[n.removeprefix("target.")] for n in group if n.removeprefix("target.") in blocks]
        if found:
            by_graph_name.update({n: found[0] for n in group})
    groups = []
    for g in products_by_input(list(graph.node), inits, set(by_graph_name)).values():
        layouts: dict[tuple, list] = {}
        for item in g:  # one merged product per layout
            layouts.setdefault(block_layout(by_graph_name[item[1]]), []).append(item)
        groups += layouts.values()
    first_of = {id(g[0][0]): g for g in groups}
    grouped = {id(n) for g in groups for n, _, _ in g}
    writer = DataWriter(root / (path.name + DATA_SUFFIX))
    kept, nodes = set(), []
    try:
        for node in graph.node:
            if id(node) not in grouped:
                nodes.append(node)
                continue
            if id(node) not in first_of:
                continue  # emitted with its group's first product
            group = first_of[id(node)]
            ws = []
            for _, name, transposed in group:
                w = by_graph_name[name]
                _check_weight(root, inits[name], transposed, w)
                ws.append(w)
                kept.add(name)
                if log:
                    log(f"kept {name} {list(w.shape)} as the file's {w.kind} blocks")
            merged = cat_blocks(ws) if len(ws) > 1 else ws[0]
            widths = [w.shape[0] for w in ws]
            nodes += _product_nodes([n for n, _, _ in group], merged, widths, spec, writer, graph)
    finally:
        writer.close()
    missing = [g[0] for g in weights if g[0] in by_graph_name and not set(g) & kept]
    if missing or not kept:
        (root / (path.name + DATA_SUFFIX)).unlink(missing_ok=True)
        what = f"no linear product reads {missing[0]}" if missing else "no linear weight is held as blocks in its file"
        raise DtrtError(f"{path.name}: {what}; export it with --quant none")
    set_nodes(graph, nodes)
    if spec.activations == "int8":
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    finish_graph(model, path, ordered=True)
    return sorted(kept), len(groups)


def _check_weight(root: Path, init: onnx.TensorProto, transposed: bool, w: BlockWeight):
    """The graph's fp32 weight must be the blocks dequantized, bit for bit."""
    have = read_initializer(root, init)
    have = have if transposed else have.T
    if tuple(have.shape) != tuple(w.shape) or not torch.equal(have.float(), dequantize(w)):
        raise DtrtError(
            f"{init.name}: the checkpoint's weight is not its GGUF blocks dequantized (the checkpoint was changed "
            "after its conversion); convert the GGUF file again: dtrt export --gguf FILE"
        )


def _product_nodes(group: list, w: BlockWeight, widths: list[int], spec: GgufQuant, writer, graph) -> list:
    """The merged product over `w` (the group's weights side by side), a Split back into each product's output when
    there are several, then each product's bias."""
    first = group[0]
    base = first.output[0]  # unique: every tensor has one producer
    biases = [n.input[2] if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2] else None for n in group]
    ends = [f"{n.output[0]}.nobias" if b else n.output[0] for n, b in zip(group, biases)]
    merged = ends[0] if len(group) == 1 else f"{base}.merged"
    x = first.input[0]
    if spec.activations == "fp32":
        out = _block_matmul(x, merged, w, base, writer, graph)
    else:
        out = _matmul_nbits(x, merged, w, base, writer, graph)
    if len(group) > 1:
        sizes = f"{base}.widths"
        out.append(
            helper.make_node(
                "Constant",
                [],
                [sizes],
                name=f"{sizes}.const",
                value=helper.make_tensor(sizes, 7, [len(widths)], widths),
            )
        )
        out.append(helper.make_node("Split", [merged, sizes], ends, name=f"{base}.split", axis=-1))
    for n, b, end in zip(group, biases, ends):
        if b:
            out.append(helper.make_node("Add", [end, b], [n.output[0]], name=f"{n.name or n.output[0]}.bias"))
    return out


def _add(writer, graph, name: str, data_type: int, array: np.ndarray) -> str:
    """An initializer in the stage's data file; int64 ones (shapes, axes: read at load) inline."""
    if data_type == TensorProto.INT64:
        graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(array, dtype=np.int64), name))
    else:
        graph.initializer.append(writer.add(name, data_type, array.shape, np.ascontiguousarray(array).tobytes()))
    return name


def _block_matmul(x: str, y: str, w: BlockWeight, base: str, writer, graph) -> list:
    p = pack_blocks(w)
    inputs = [
        x,
        _add(writer, graph, f"{base}.codes", TensorProto.UINT8, p.q),
        _add(writer, graph, f"{base}.scale", TensorProto.FLOAT, p.scale),
    ]
    if p.min is not None:
        inputs.append(_add(writer, graph, f"{base}.min", TensorProto.FLOAT, p.min))
    attrs = {"bits": p.bits, "block": p.block, "zero": p.zero}
    return [helper.make_node(p.op, inputs, [y], name=f"{base}.blocks", domain=DOMAIN, **attrs)]


def nbits_inputs(w: BlockWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """MatMulNBits' B [N, blocks, block * bits / 8], scales [N * blocks], zero points and bits for `w`: 4 bits where
    every code fits (elements in order, the first of each pair in the low nibble; zero points likewise, one per
    block), else 8."""
    codes, zero = codes_uint8(w)
    n, k = codes.shape
    nb = k // w.block
    bits = 4 if codes.max(initial=0) < 16 and zero < 16 else 8
    if bits == 4:
        pairs = codes.reshape(n, nb, w.block // 2, 2)
        b = pairs[..., 0] | (pairs[..., 1] << 4)
        zp = np.full((n, (nb + 1) // 2), zero | (zero << 4), dtype=np.uint8)
    else:
        b = codes.reshape(n, nb, w.block)
        zp = np.full((n, nb), zero, dtype=np.uint8)
    return b.astype(np.uint8), w.scale.numpy().reshape(-1), zp, bits


def _matmul_nbits(x: str, y: str, w: BlockWeight, base: str, writer, graph) -> list:
    b, scales, zp, bits = nbits_inputs(w)
    n, k = w.shape
    codes = y if w.min is None else f"{base}.coded"
    out = [
        helper.make_node(
            "MatMulNBits",
            [
                x,
                _add(writer, graph, f"{base}.codes", TensorProto.UINT8, b),
                _add(writer, graph, f"{base}.scale", TensorProto.FLOAT, scales),
                _add(writer, graph, f"{base}.zero", TensorProto.UINT8, zp),
            ],
            [codes],
            name=f"{base}.nbits",
            domain=MS_DOMAIN,
            K=k,
            N=n,
            bits=bits,
            block_size=w.block,
            accuracy_level=A8_ACCURACY,
        )
    ]
    if w.min is None:
        return out
    # the min term: each row's block sums times the mins, [rows, K/block] x [K/block, N]
    shape = _add(writer, graph, f"{base}.blockshape", TensorProto.INT64, np.array([-1, k // w.block, w.block]))
    mins = _add(writer, graph, f"{base}.minT", TensorProto.FLOAT, w.min.T.contiguous().numpy())
    out += [
        helper.make_node("Reshape", [x, shape], [f"{base}.xb"], name=f"{base}.xb"),
        helper.make_node(
            "ReduceSum", [f"{base}.xb", f"{base}.axis"], [f"{base}.bsum"], name=f"{base}.bsum", keepdims=0
        ),
        helper.make_node("MatMul", [f"{base}.bsum", mins], [f"{base}.mterm"], name=f"{base}.mterm"),
        helper.make_node("Shape", [codes], [f"{base}.yshape"], name=f"{base}.yshape"),
        helper.make_node("Reshape", [f"{base}.mterm", f"{base}.yshape"], [f"{base}.mrows"], name=f"{base}.mrows"),
        helper.make_node("Add", [codes, f"{base}.mrows"], [y], name=f"{base}.withmin"),
    ]
    _add(writer, graph, f"{base}.axis", TensorProto.INT64, np.array([-1]))
    return out

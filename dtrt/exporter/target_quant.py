"""`dtrt export --quant int8|int4`: the target stage's linear layers (the lm_head included) as weight-only
quantized matrix products, in the standard ONNX form both runtimes take:

    DequantizeLinear(q, scale) -> MatMul(x, .)
    int8  q int8 [in, out], scale [out], axis 1 (per output channel)
    int4  q int4 [in, out], scale [ceil(in / block), out], axis 0, block_size = block

No zero point (symmetric). ONNX Runtime fuses each pair into its MatMulNBits CPU kernel at session load (int8 and
int4 alike), TensorRT reads it as weight-only INT8 / INT4 quantization. The integers and scales come from
`dtrt.models.quant`, the same functions the PyTorch reference dequantizes with. The full-precision embedding stays
for the lookup; a tied lm_head gets its own quantized copy.

The weights are read one at a time from the stage's data file and the quantized ones written to their own data
file, so a large target is never whole in memory.
"""

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from dtrt.exporter.ordered_attention import ordered_attention_nodes
from dtrt.exporter.rotary import ROTARY_OPSET, rotary_nodes
from dtrt.exporter.weights import external
from dtrt.models.quant import quantize
from dtrt.models.quant_spec import QuantSpec
from dtrt.ops import DOMAIN, onnx_functions
from dtrt.ops.tree_attention import ORDER_ALIGN, ORDER_ROWS

QUANT_OPSET = ROTARY_OPSET  # int4 tensors and blocked DequantizeLinear (21), RotaryEmbedding (23)
# what the runtime must do for a quantized target (manifest "ordered_attention"): pad every target call to at least
# MIN_ROWS rows (one row takes other kernels than two or more; an even count at int4 blocks of 64 or more, which pair
# rows: dtrt.runtime.backends.exported.target_rows) and keep a tree inside its past's ALIGN-aligned block
# (dtrt.ops.tree_attention: the ordered attention)
MIN_ROWS = 2


def ordered_attention(quant) -> dict:
    """The manifest's `ordered_attention` of a target quantized as `quant`: a gguf target's fp32 products
    (dtrt::BlockMatMul) take any number of rows alike, so its calls need no padding."""
    fp32_products = getattr(quant, "activations", None) == "fp32"
    return {"align": ORDER_ALIGN, "max_rows": ORDER_ROWS, "min_rows": 1 if fp32_products else MIN_ROWS}


DATA_SUFFIX = ".quant.data"
FLOAT_TYPES = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
}


def pack_int4(q: np.ndarray) -> bytes:
    """int8 values in [-8, 7] -> ONNX INT4 raw data: two per byte, the first in the low nibble."""
    flat = q.astype(np.int8).ravel()
    if flat.size % 2:
        flat = np.concatenate((flat, np.zeros(1, np.int8)))
    u = flat.view(np.uint8) & 0x0F
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    """The inverse of pack_int4: `count` int8 values."""
    b = np.frombuffer(raw, np.uint8)
    u = np.empty(b.size * 2, np.uint8)
    u[0::2], u[1::2] = b & 0x0F, b >> 4
    return ((u[:count].astype(np.int16) ^ 8) - 8).astype(np.int8)  # sign-extend the nibble


def read_initializer(root: Path, init: onnx.TensorProto) -> torch.Tensor:
    info = external(init)
    if info is None:
        arr = onnx.numpy_helper.to_array(init)
        return torch.from_numpy(np.array(arr))
    with open(root / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        raw = bytearray(f.read(int(info["length"])))
    dtype = FLOAT_TYPES.get(init.data_type)
    if dtype is None:
        raise ValueError(f"initializer {init.name}: data type {init.data_type} is not a float type")
    return torch.frombuffer(raw, dtype=dtype).reshape(tuple(init.dims))


class DataWriter:
    """Tensors appended to one external-data file, each initializer pointing at its bytes."""

    def __init__(self, path: Path):
        self.path, self.file = path, open(path, "wb")

    def add(self, name: str, data_type: int, dims, raw: bytes) -> onnx.TensorProto:
        t = TensorProto(name=name, data_type=data_type, dims=list(dims))
        offset = self.file.tell()
        self.file.write(raw)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(len(raw)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def close(self):
        self.file.close()


def weight_input(node: onnx.NodeProto, inits: dict) -> tuple[str, bool] | None:
    """(weight initializer, stored transposed) of a linear product: Gemm(x, W^T) as torch exports nn.Linear, or
    MatMul(x, W) with a constant W [in, out]; None for any other node."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm" and node.input[1] in inits:
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return None
        return node.input[1], bool(attrs.get("transB", 0))
    if node.op_type == "MatMul" and node.input[1] in inits and len(inits[node.input[1]].dims) == 2:
        return node.input[1], False
    return None


def products_by_input(nodes: list, inits: dict, wanted: set) -> dict[int, list[tuple]]:
    """The linear products to quantize, grouped by the activation they read (id of the group's first node -> its
    (node, weight name, stored transposed) triples). A layer's q/k/v read one input, as do gate/up: one quantized
    product over their weights side by side is one activation quantization and one kernel call instead of three,
    and each output column is the same dot product as alone, so the outputs are bit for bit the separate
    products'. Weights read by more than one product (a tied lm_head) stay alone."""
    found = [(n, *w) for n in nodes if (w := weight_input(n, inits)) is not None and w[0] in wanted]
    readers: dict[str, int] = {}
    for _, name, _ in found:
        readers[name] = readers.get(name, 0) + 1
    groups: dict = {}
    for n, name, transposed in found:
        key = n.input[0] if readers[name] == 1 else id(n)
        groups.setdefault(key, []).append((n, name, transposed))
    return {id(g[0][0]): g for g in groups.values()}


def quantize_target(path: Path, spec: QuantSpec, weights: list[tuple[str, ...]], log=None) -> tuple[list[str], int]:
    """Rewrite the stage graph at `path` so that every linear product whose weight initializer has a name in
    `weights` (one tuple of names per weight: a tied one has several) runs on `spec`'s quantized weights, products
    of one activation merged (`_products`); returns (the initializers quantized, the quantized products). Every
    weight must be found (the reference dequantizes exactly these), else ValueError."""
    wanted = {name for group in weights for name in group}
    path = Path(path)
    root = path.parent
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    writer = DataWriter(root / (path.name + DATA_SUFFIX))
    groups = products_by_input(list(graph.node), inits, wanted)
    grouped = {id(n) for g in groups.values() for n, _, _ in g}
    done: dict[str, tuple[str, str, list[int]]] = {}  # a group's first weight -> (q name, scale name, widths)
    quantized: set[str] = set()
    nodes = []
    try:
        for node in graph.node:
            if id(node) not in grouped:
                nodes.append(node)
                continue
            if id(node) not in groups:
                continue  # emitted with its group's first product
            group = groups[id(node)]
            key = group[0][1]
            if key not in done:
                qs, ss = [], []
                for _, name, transposed in group:
                    w = read_initializer(root, inits[name])
                    q, scale = quantize(w if transposed else w.T, spec)  # [out, in]
                    qs.append(q)
                    ss.append(scale)
                    quantized.add(name)
                    if log:
                        log(f"quantized {name} {list(q.shape)} to {spec.name}")
                q, scale = torch.cat(qs), torch.cat(ss)
                qt = q.T.contiguous().numpy()  # [in, out]
                st = scale.T.contiguous() if spec.block else scale[:, 0].contiguous()  # [groups, out] or [out]
                base = key if len(group) == 1 else f"{key}+{len(group) - 1}"
                qname, sname = f"{base}.q{spec.bits}", f"{base}.scale"
                if spec.bits == 4:
                    q_init = writer.add(qname, TensorProto.INT4, qt.shape, pack_int4(qt))
                else:
                    q_init = writer.add(qname, TensorProto.INT8, qt.shape, qt.tobytes())
                s_type = inits[key].data_type
                s_raw = st.view(torch.int16) if st.dtype == torch.bfloat16 else st  # numpy has no bfloat16
                s_init = writer.add(sname, s_type, st.shape, s_raw.numpy().tobytes())
                graph.initializer.extend([q_init, s_init])
                done[key] = (qname, sname, [q.shape[0] for q in qs])
            nodes.extend(_product_nodes([n for n, _, _ in group], *done[key], spec))
    finally:
        writer.close()
    missing = [group[0] for group in weights if not set(group) & quantized]
    if missing:
        (root / (path.name + DATA_SUFFIX)).unlink(missing_ok=True)
        raise ValueError(f"{path.name}: no linear product reads {missing[0]} ({len(missing)} weights not found)")
    set_nodes(graph, nodes)
    finish_graph(model, path, ordered=True)
    return sorted(quantized), len(groups)


def finish_graph(model: onnx.ModelProto, path: Path, *, ordered: bool):
    """A target graph whose products were rewritten, made whole and saved at `path`: the ordered attention where
    `ordered` (int8 activations), RoPE as RotaryEmbedding, the function bodies of the dtrt ops it uses, only the
    initializers it reads, the opset those need; then checked."""
    graph = model.graph
    if ordered:
        set_nodes(graph, ordered_attention_nodes(graph))
    set_nodes(graph, rotary_nodes(graph, Path(path).parent)[0])
    used_ops = {n.op_type for n in graph.node if n.domain == DOMAIN}
    functions = [f for f in model.functions if f.name in used_ops]
    functions += [f for f in onnx_functions(used_ops) if f.name not in {g.name for g in functions}]
    del model.functions[:]
    model.functions.extend(functions)
    used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    set_opset(model, QUANT_OPSET)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))


def _product_nodes(group: list, qname: str, sname: str, widths: list[int], spec: QuantSpec) -> list:
    """DequantizeLinear -> MatMul over the group's weights side by side (`qname`, `sname`: the integers and scales
    of the weights of `widths` output features each), a Split back into each product's output when there are
    several, then each product's bias."""
    first = group[0]
    base = first.output[0]  # unique: every tensor has one producer
    deq = f"{base}.dequantized"
    kwargs = {"axis": 0, "block_size": spec.block} if spec.block else {"axis": 1}
    out = [helper.make_node("DequantizeLinear", [qname, sname], [deq], name=f"{deq}.dq", **kwargs)]
    biases = [n.input[2] if n.op_type == "Gemm" and len(n.input) > 2 and n.input[2] else None for n in group]
    ends = [f"{n.output[0]}.nobias" if b else n.output[0] for n, b in zip(group, biases)]
    if len(group) == 1:
        out.append(helper.make_node("MatMul", [first.input[0], deq], ends, name=f"{base}.matmul"))
    else:
        merged, sizes = f"{base}.merged", f"{base}.widths"
        out.append(helper.make_node("MatMul", [first.input[0], deq], [merged], name=f"{base}.matmul"))
        widths_t = helper.make_tensor(sizes, TensorProto.INT64, [len(widths)], widths)
        out.append(helper.make_node("Constant", [], [sizes], name=f"{sizes}.const", value=widths_t))
        out.append(helper.make_node("Split", [merged, sizes], ends, name=f"{base}.split", axis=-1))
    for n, b, end in zip(group, biases, ends):
        if b:
            out.append(helper.make_node("Add", [end, b], [n.output[0]], name=f"{n.name or n.output[0]}.bias"))
    return out


def set_nodes(graph: onnx.GraphProto, nodes: list):
    del graph.node[:]
    graph.node.extend(nodes)


def set_opset(model: onnx.ModelProto, version: int):
    for imports in [model.opset_import, *(f.opset_import for f in model.functions)]:
        for op in imports:
            if op.domain in ("", "ai.onnx"):
                op.version = max(op.version, version)

"""`dtrt export --drafter-quant int8|int4`: the drafters' stages with quantized weights, for ONNX Runtime on the CPU.

A block stage is the draft layers and the target's lm_head over the rows a round asks for; a context stage
projects the target's hidden states into the drafter's K/V. At batch 1 their cost is reading the weights: a round
runs them right after the target's step, which has pushed them out of the CPU's caches, so a round's drafting time
follows the bytes its weights take. Drafts need not be exact: the target, which stays in the export's dtype,
verifies every drafted token, so the output is unchanged and only acceptance can move.

Both modes quantize the context stages' products to int4 weights per block of CONTEXT_BLOCK, weight-only (the
target's `--quant int4` form, ONNX Runtime's MatMulNBits, which quantizes each row's activations per block), and
the block stages' draft layers to int8 weights per output channel with uint8 activations per tensor, measured at
run time (ONNX Runtime's dynamic quantization, MatMulInteger). They differ in the block's lm_head:
  - int8: as the draft layers (its activations quantized over every proposal row: `whole_rows_scale`);
  - int4: int4 weights per block of HEAD_BLOCK, weight-only; it reads an even number of rows (`head_even_rows`).
Why each:
  - the context stage's activations are the target's hidden states, whose few large features a per-tensor uint8
    scale flattens: dynamic int8 there cost 5% of tau on SmolLM2 (MT-Bench and HumanEval, budget 1), weight-only
    int4 0.8% (budget 4), and its 8.4 MB of fp32 weights fall to 1.3;
  - the draft layers take 8 block rows, where MatMulNBits ran slower than MatMulInteger at these sizes;
  - the lm_head reads the rows a round asks for: at budget 1 int4 cut SmolLM2's drafting by 0.4 ms a round for
    0.5% of tau, but in the trees of budget 4 it cost 2.6% more tau than int8 for no speed.
On SmolLM2-135M (16K draft vocabulary, one thread, the int8 target, side by side in one process) drafting went
from 3.07 ms a round (the int8 block with an fp32 context, before) to 2.68 with int8 and 2.28 with int4 at budget
1, and from 3.28 to 2.93 with int8 at budget 4.

The int8 weights use 7 bits (reduce_range: -64..64). A CPU without VNNI (AVX2 only) multiplies uint8 by int8 in
pairs summed in int16 (vpmaddubsw), which saturates once a pair passes 32,767 (255 x 127 x 2 can reach 64,770): on
such a CPU the SmolLM2 block's logits came out at cosine 0.986 to the fp32 reference with 8-bit weights, 0.9955 with
7-bit. With 7 bits no pair can saturate (255 x 64 x 2 = 32,640), so every CPU computes the same exact integer sums
and drafts the same tokens; a VNNI CPU, which never saturates, gives up a little (SmolLM2's lm_head on real hidden
states, the exact integer sums emulated: cosine 0.9997-0.9999 and rel 0.02-0.03 at 8 bits, 0.9991-0.9999 and
0.04-0.06 at 7). int4 weights (0..15 after their offset) cannot saturate a pair either.
A row's base logits do not depend on how many rows a round asks for: the int8 lm_head's activations are quantized
over every proposal row, the int4 one's row by row over an even number of rows.
"""

import logging
import os
from pathlib import Path

import numpy as np

from dtrt.errors import DtrtError
from dtrt.models.quant_spec import quant_spec

QUANT_STAGES = {"none": (), "int8": ("block", "context"), "int4": ("block", "context")}  # per drafter kind
HEAD_BLOCK = 128  # than 32: the SmolLM2 block 0.17 ms a round faster, 0.8% less tau at budget 4; see head_even_rows
CONTEXT_BLOCK = 32
HEAD_INPUT = "ph"  # the block stage's proposal rows, which its lm_head reads


def quantized_stages(stage_names, quant: str) -> list[str]:
    """The stages `quant` rewrites: every drafter kind's block and context stages."""
    return [name for name in stage_names if name.partition(".")[2] in QUANT_STAGES[quant]]


def quantize_drafter(path: Path, name: str, quant: str, log=None):
    """Rewrite the drafter stage `name` at `path`, one of the stages `quant` covers (quantized_stages)."""
    if log:
        log(f"quantizing {name} to {quant}")
    if name.endswith(".context"):
        quantize_weights(path, quant_spec("int4", CONTEXT_BLOCK), lambda node: True)
    elif quant == "int8":
        quantize_stage(path)
    else:
        quantize_weights(path, quant_spec("int4", HEAD_BLOCK), lambda node: node.input[0] == HEAD_INPUT)
        quantize_stage(path, whole_rows=False, rewrite=head_even_rows)


def quantize_weights(path: Path, spec, chosen) -> None:
    """The linear products of the stage at `path` for which `chosen(node)` holds, as weight-only `spec` products
    (dtrt.exporter.target_quant's form; their integers in `<stage>.quant.data`)."""
    import onnx

    from dtrt.exporter.target_quant import quantize_target, weight_input

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    names = sorted({(w[0],) for n in graph.node if (w := weight_input(n, inits)) is not None and chosen(n)})
    if not names:
        raise DtrtError(f"{path.name}: no linear product to quantize to {spec.name}")
    quantize_target(path, spec, names)


def quantize_stage(path: Path, whole_rows: bool = True, rewrite=None):
    """Replace the stage at `path` (and its data files) by its dynamically quantized int8 version (7-bit weights);
    `whole_rows`: quantize the lm_head's activations over every proposal row (whole_rows_scale; an lm_head already
    quantized otherwise has no activations of its own to quantize); `rewrite(model)`: a last graph pass."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from dtrt.exporter.target_quant import DATA_SUFFIX

    path = Path(path)
    tmp = path.with_name(f".q-{path.name}")
    tmp_data = tmp.with_name(tmp.name + ".data")
    logging.disable(logging.WARNING)  # its advice to pre-process (shape inference) is for conv nets
    try:
        quantize_dynamic(
            path,
            tmp,
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=True,  # no int16 saturation without VNNI (see above)
            op_types_to_quantize=["MatMul", "Gemm"],
            use_external_data_format=True,
            extra_options={"MatMulConstBOnly": True},
        )
        import onnx

        model = onnx.load(str(tmp))  # the weights, renamed to the stage's own .data file
        if whole_rows:
            whole_rows_scale(model)
        if rewrite is not None:
            rewrite(model)
        data = path.with_name(path.name + ".data")
        for f in (path, data, path.with_name(path.name + DATA_SUFFIX)):  # every weight is in `model` now
            f.unlink(missing_ok=True)
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=1024,
        )
    finally:
        logging.disable(logging.NOTSET)
        for f in (tmp, tmp_data):
            if f.exists():
                os.remove(f)


def lm_head_input(graph, op_type: str, rows_output: str):
    """The one `op_type` node reading the block stage's `rows_output` (the lm_head's first node), and the inputs of
    the Slice that makes `rows_output` from every proposal row: (node, [data, starts, axes, steps...])."""
    producer = {o: n for n in graph.node for o in n.output}
    readers = [n for n in graph.node if n.op_type == op_type and n.input[0] == rows_output]
    cut = producer.get(rows_output)
    if len(readers) != 1 or cut is None or cut.op_type != "Slice" or len(cut.input) < 4 or not cut.input[3]:
        raise DtrtError(f"the block stage's {rows_output} is not the one sliced input of its lm_head ({op_type})")
    data, starts, _, axes = cut.input[:4]
    return readers[0], [data, starts, axes, *cut.input[4:5]]


def whole_rows_scale(model, rows_input: str = "rows", rows_output: str = HEAD_INPUT):
    """Quantize the lm_head's activations over every proposal row, then take the first `rows`: the stage's `ph`
    output is Slice(x, start, start + rows) on the rows axis and the lm_head's DynamicQuantizeLinear reads it; it
    reads Slice(x, start, end of x) instead (the proposal rows run to the block's end: k_draft = B - first_row), and
    its quantized rows are sliced to `rows` before the product."""
    from onnx import helper, numpy_helper

    graph = model.graph
    dql, (data, starts, axes, *steps) = lm_head_input(graph, "DynamicQuantizeLinear", rows_output)
    end, start = np.array([np.iinfo(np.int64).max]), np.array([0])
    graph.initializer.extend(
        [numpy_helper.from_array(end, "whole_rows_end"), numpy_helper.from_array(start, "whole_rows_start")]
    )
    whole = helper.make_node("Slice", [data, starts, "whole_rows_end", axes, *steps], ["whole_rows"])
    first = helper.make_node("Slice", [dql.output[0], "whole_rows_start", rows_input, axes], ["whole_rows_quantized"])
    for n in graph.node:  # the products read the sliced quantized rows
        n.input[:] = ["whole_rows_quantized" if i == dql.output[0] else i for i in n.input]
    dql.input[0] = "whole_rows"
    at = list(graph.node).index(dql)
    graph.node.insert(at + 1, first)
    graph.node.insert(at, whole)


def head_even_rows(model, rows_input: str = "rows", rows_output: str = HEAD_INPUT):
    """The int4 lm_head reads an even number of proposal rows (`rows` rounded up, as far as the block has rows) and
    its logits are cut to `rows` after. ONNX Runtime's int4 product at blocks of 64 or more input features computes
    rows in pairs and an odd last row alone, in another kernel whose sums differ in the last bits: without this a
    row's base logits, hence its drafts near a tie, would depend on how many rows a round asks for."""
    from onnx import helper, numpy_helper

    graph = model.graph
    head, (data, starts, axes, *steps) = lm_head_input(graph, "MatMul", rows_output)
    graph.initializer.extend(
        [numpy_helper.from_array(np.array([2]), "head_pair"), numpy_helper.from_array(np.array([0]), "head_first_row")]
    )
    logits = head.output[0]
    head.input[0], head.output[0] = "head_rows", "head_rows_logits"
    before = [
        helper.make_node("Mod", [rows_input, "head_pair"], ["head_odd_row"]),
        helper.make_node("Add", [rows_input, "head_odd_row"], ["head_rows_count"]),
        helper.make_node("Add", [starts, "head_rows_count"], ["head_rows_end"]),
        helper.make_node("Slice", [data, starts, "head_rows_end", axes, *steps], ["head_rows"]),
    ]
    after = helper.make_node("Slice", ["head_rows_logits", "head_first_row", rows_input, axes], [logits])
    at = list(graph.node).index(head)
    graph.node.insert(at + 1, after)
    for node in reversed(before):
        graph.node.insert(at, node)

"""`dtrt export --drafter-quant int8`: the drafters' block stages with int8 weights, for ONNX Runtime on the CPU.

A block stage is one draft layer and the target's lm_head over the block's positions. At batch 1 its cost is
reading the weights, and the lm_head ([vocab, hidden], 113 MB in fp32 for SmolLM2) is most of them, so int8
weights make the stage about 2.5x faster. Drafts need not be exact: the target, which stays in the export's
dtype, verifies every drafted token, so the output is unchanged and only acceptance can move.

ONNX Runtime's dynamic quantization: weights int8 per output channel, activations uint8 per tensor, measured at
run time (MatMulInteger). The context stages, the scorer stages and the target are left as exported.
The lm_head reads the first `rows` proposal rows only, but its activations are quantized over all of them, as
before the block took `rows` (`whole_rows_scale`): each row's integer products, hence its base logits, are the same
whatever `rows` a round asks for, and drafts stay those of every row.

The weights use 7 bits (reduce_range: -64..64). A CPU without VNNI (AVX2 only) multiplies uint8 by int8 in pairs
summed in int16 (vpmaddubsw), which saturates once a pair passes 32,767 (255 x 127 x 2 can reach 64,770): on such
a CPU the SmolLM2 block's logits came out at cosine 0.986 to the fp32 reference with 8-bit weights, 0.9955 with 7-bit.
With 7 bits no pair can saturate (255 x 64 x 2 = 32,640), so every CPU computes the same exact integer sums and
drafts the same tokens; a VNNI CPU, which never saturates, gives up a little (SmolLM2's lm_head on real hidden
states, the exact integer sums emulated: cosine 0.9997-0.9999 and rel 0.02-0.03 at 8 bits, 0.9991-0.9999 and
0.04-0.06 at 7).
"""

import logging
import os
from pathlib import Path

import numpy as np

from dtrt.errors import DtrtError

DRAFTER_QUANTS = ("none", "int8")
QUANT_STAGES = ("block",)  # per drafter kind


def check_drafter_quant(quant: str, dtype: str):
    if quant not in DRAFTER_QUANTS:
        raise DtrtError(f"--drafter-quant {quant!r}: use one of {', '.join(DRAFTER_QUANTS)}")
    if quant != "none" and dtype != "fp32":
        raise DtrtError(f"--drafter-quant {quant} quantizes fp32 weights; use it with --dtype fp32")


def quantized_stages(stage_names, quant: str) -> list[str]:
    """The stages `quant` rewrites: every drafter kind's block stage."""
    if quant == "none":
        return []
    return [name for name in stage_names if name.partition(".")[2] in QUANT_STAGES]


def quantize_drafters(root: Path, stages: dict, quant: str, log=None) -> list[str]:
    """Rewrite, under `root`, the stages of `stages` (name -> {"file", ...}) that `quant` covers; their names."""
    names = quantized_stages(stages, quant)
    for name in names:
        if log:
            log(f"quantizing {name} to {quant}")
        quantize_stage(Path(root) / stages[name]["file"])
    return names


def quantize_stage(path: Path):
    """Replace the stage at `path` (and its .data file) by its dynamically quantized int8 version (7-bit weights)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

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
        whole_rows_scale(model)
        data = path.with_name(path.name + ".data")
        for f in (path, data):
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


def whole_rows_scale(model, rows_input: str = "rows", rows_output: str = "ph"):
    """Quantize the lm_head's activations over every proposal row, then take the first `rows`: the stage's `ph`
    output is Slice(x, start, start + rows) on the rows axis and the lm_head's DynamicQuantizeLinear reads it; it
    reads Slice(x, start, end of x) instead (the proposal rows run to the block's end: k_draft = B - first_row), and
    its quantized rows are sliced to `rows` before the product."""
    from onnx import helper, numpy_helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    quant = [n for n in graph.node if n.op_type == "DynamicQuantizeLinear" and n.input[0] == rows_output]
    cut = producer.get(rows_output)
    if len(quant) != 1 or cut is None or cut.op_type != "Slice" or len(cut.input) < 4 or not cut.input[3]:
        raise DtrtError(f"the block stage's {rows_output} is not the one sliced input of its lm_head's quantization")
    dql = quant[0]
    data, starts, _, axes = cut.input[:4]
    steps = list(cut.input[4:5])
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

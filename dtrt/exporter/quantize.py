"""`dtrt export --drafter-quant int8`: the drafters' block stages with int8 weights, for ONNX Runtime on the CPU.

A block stage is one draft layer and the target's lm_head over the block's positions. At batch 1 its cost is
reading the weights, and the lm_head ([vocab, hidden], 113 MB in fp32 for SmolLM2) is most of them, so int8
weights make the stage about 2.5x faster. Drafts need not be exact: the target, which stays in the export's
dtype, verifies every drafted token, so the output is unchanged and only acceptance can move.

ONNX Runtime's dynamic quantization: weights int8 per output channel, activations uint8 per tensor, measured at
run time (MatMulInteger). The context stages, the scorer stages and the target are left as exported.

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

"""The ONNX functions of the dtrt ops, one module per op: imported only to export (onnxscript, which writes them,
takes seconds to import, and running an export never needs it)."""

from dtrt.ops.functions import (  # noqa: F401 (each module registers its functions)
    block_matmul,
    ledger_select,
    topm_corrected_score,
    tree_attention,
    tree_causal_conv1d,
    tree_gated_delta_net,
)
from dtrt.ops.functions.opset import FUNCTIONS

__all__ = ["FUNCTIONS"]

"""The custom ops of the plugin boundary (DESIGN.md section 5).

Each op is defined once: an eager PyTorch implementation (the reference, also registered as
`torch.ops.dtrt.<name>`), and an ONNX function `dtrt::<Name>` of standard ops. During `torch.onnx.export`
the models emit a `dtrt` domain node instead of the eager math, and the exporter attaches the function
bodies as model-local functions, so ONNX Runtime runs the node as is and TensorRT can map it to a plugin
of the same name, version and namespace. Called eagerly, an op runs its Triton kernel (dtrt.plugins) on a
CUDA device and its reference elsewhere (dtrt.ops.kernels).
"""

from dtrt.ops.base import DOMAIN, VERSION, emit, onnx_functions
from dtrt.ops.ledger_select import ledger_select
from dtrt.ops.topm_corrected_score import topm_corrected_score
from dtrt.ops.tree_attention import tree_attention
from dtrt.ops.tree_causal_conv1d import tree_causal_conv1d
from dtrt.ops.tree_gated_delta_net import tree_gated_delta_net

__all__ = [
    "DOMAIN",
    "VERSION",
    "emit",
    "ledger_select",
    "onnx_functions",
    "topm_corrected_score",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_gated_delta_net",
]

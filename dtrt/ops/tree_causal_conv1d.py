"""TreeCausalConv1d: a Gated-DeltaNet layer's short causal depthwise convolution (+ SiLU) over tree nodes.

x [N, C] (the nodes' inputs, parents before children), parents [N] int64 (-1: the node follows the committed
sequence), conv_state [C, K-1] (the last K-1 committed inputs, oldest first), weight [C, K]
-> out [N, C] = SiLU(sum_j weight[:, j] * window_i[:, j]),
   windows [N, C, K-1] (the conv state after each node: the last K-1 entries of its window).

Node i's window is its own ancestor chain, [..., grandparent, parent, i], continued into conv_state above the
root, never a sibling's input. Leading batch dims on x and conv_state are allowed (one parents for all).
"""

import torch
import torch.nn.functional as F

from dtrt.ops.base import emit
from dtrt.ops.kernels import kernel


def window_index(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """[N, K] rows into cat(conv_state columns, x): each node's window, oldest first. Column c of the conv
    state sits at row c, node i at row K-1+i; above the root the chain continues into the newest column."""
    n, ctx = parents.shape[0], kernel - 1
    columns = (torch.arange(ctx, device=parents.device) - 1).clamp(min=0)
    up = torch.cat((columns, torch.where(parents >= 0, parents + ctx, ctx - 1)))  # row -> the row before it
    rows = [torch.arange(ctx, ctx + n, device=parents.device)]
    for _ in range(ctx):
        rows.insert(0, up[rows[0]])
    return torch.stack(rows, dim=-1)


def tree_causal_conv1d_ref(
    x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.cat((conv_state.transpose(-1, -2).to(x.dtype), x), dim=-2)  # [..., K-1+N, C]
    window = src[..., window_index(parents, weight.shape[-1]), :]  # [..., N, K, C]
    out = F.silu((window * weight.transpose(0, 1).to(x.dtype)).sum(-2))
    return out, window[..., 1:, :].transpose(-1, -2).contiguous()


torch.library.custom_op("dtrt::tree_causal_conv1d", mutates_args=())(tree_causal_conv1d_ref)


def tree_causal_conv1d(x, parents, conv_state, weight):
    """A `dtrt::TreeCausalConv1d` node during ONNX export (batch-free inputs); eagerly the Triton kernel
    or the reference (dtrt.ops.kernels)."""
    if x.dim() == 2:
        if torch.onnx.is_in_onnx_export():
            n, c = x.shape
            return emit(
                "TreeCausalConv1d",
                (x, parents, conv_state, weight),
                (x.dtype, x.dtype),
                ((n, c), (n, c, weight.shape[-1] - 1)),
            )
        if (run := kernel("tree_causal_conv1d", x, conv_state, weight)) is not None:
            return run(x, parents, conv_state, weight)
    return tree_causal_conv1d_ref(x, parents, conv_state, weight)

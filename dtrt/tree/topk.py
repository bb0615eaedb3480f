"""A top-k whose order among equal values is defined: descending, the lower index first.

That is ONNX TopK's order, which an exported stage runs. torch.topk leaves the order of equal values to its kernel,
whose choice follows the other values of the row, so where a stage's inputs can tie (a quantized lm_head's logits,
the -inf outside a draft vocabulary, padding lanes) its PyTorch reference could pick other indices than the graph.
"""

import torch


def topk_lower_first(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along `dim`, equal values in ascending index order. Exported, a TopK node;
    eagerly a top-k over keys that are unique and ordered as (value, -index), for floats of up to 32 bits."""
    if torch.onnx.is_in_onnx_export():
        return torch.topk(x, k, dim=dim)
    x = x.movedim(dim, -1)
    bits = (x.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, which it equals
    rank = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # ascending with the value
    n = x.shape[-1]
    key = (rank << 32) | (n - 1 - torch.arange(n, device=x.device))  # within one value, the lower index ranks higher
    index = torch.topk(key, k, dim=-1).indices
    return x.gather(-1, index).movedim(-1, dim), index.movedim(-1, dim)

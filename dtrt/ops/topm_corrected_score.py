"""TopMCorrectedScore: DominoTree's per-node score over the M base candidates of one depth.

zproj [bs, E] fp32 (W1[:, :H] . ph_d, per round), states [bs, n, G] (GRU path states, model dtype),
w1s [E, G] (W1[:, H:], model dtype), basec [bs, M] fp32 (base logits at the candidates),
w2c [bs, M, E] fp32 (W2 rows of the candidates) -> logprobs [bs, n, M] fp32:

    log_softmax(basec + SiLU(zproj + W1s . s) . W2c^T)   over the M candidates

W1s . s runs in the model dtype and everything after it in fp32, as DominoScorer does.
"""

import torch
import torch.nn.functional as F

from dtrt.ops.base import emit
from dtrt.ops.kernels import kernel


def topm_corrected_score_ref(
    zproj: torch.Tensor, states: torch.Tensor, w1s: torch.Tensor, basec: torch.Tensor, w2c: torch.Tensor
) -> torch.Tensor:
    h = F.silu(zproj.unsqueeze(-2) + F.linear(states.to(w1s.dtype), w1s).float())
    return torch.log_softmax(basec.unsqueeze(-2) + h @ w2c.transpose(-1, -2), dim=-1)


torch.library.custom_op("dtrt::topm_corrected_score", mutates_args=())(topm_corrected_score_ref)


def topm_corrected_score(zproj, states, w1s, basec, w2c):
    """A `dtrt::TopMCorrectedScore` node during ONNX export; eagerly the Triton kernel or the reference
    (dtrt.ops.kernels)."""
    if torch.onnx.is_in_onnx_export():
        shape = (*states.shape[:-1], basec.shape[-1])
        return emit("TopMCorrectedScore", (zproj, states, w1s, basec, w2c), (torch.float32,), (shape,))
    if (run := kernel("topm_corrected_score", states, zproj, w1s, basec, w2c)) is not None:
        return run(zproj, states, w1s, basec, w2c)
    return topm_corrected_score_ref(zproj, states, w1s, basec, w2c)

"""TreeGatedDeltaNet: the gated delta rule over tree nodes, each node continuing its parent's recurrent state.

q, k [N, H, dk] (L2-normalised, q also scaled by dk^-1/2), v [N, H, dv], g [N, H] (log decay, <= 0),
beta [N, H], parents [N] int64 (-1: the node continues state0), state0 [H, dk, dv], all fp32
-> out [N, H, dv], states [N, H, dk, dv] (the recurrent state after each node), fp32.

    S = exp(g_i) S_parent(i);   S += k_i (beta_i (v_i - k_i^T S))^T;   out_i = q_i^T S

Node i never sees a sibling's update, so verifying a tree gives every node the state of its own path, and a
commit takes the state of the last accepted node as it is. Leading batch dims are allowed (one parents for all).
"""

import torch
import torch.nn.functional as F

from dtrt.ops.base import emit
from dtrt.ops.kernels import kernel


def tree_gated_delta_net_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    state0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    states, outs = [], []
    for i, p in enumerate(parents.tolist()):
        s = (states[p] if p >= 0 else state0) * g[..., i, :, None, None].exp()
        k_i = k[..., i, :, :, None]
        delta = (v[..., i, :, :] - (s * k_i).sum(-2)) * beta[..., i, :, None]
        s = s + k_i * delta.unsqueeze(-2)
        states.append(s)
        outs.append((s * q[..., i, :, :, None]).sum(-2))
    return torch.stack(outs, dim=-3), torch.stack(states, dim=-4)


torch.library.custom_op("dtrt::tree_gated_delta_net", mutates_args=())(tree_gated_delta_net_ref)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = 16):
    """The same rule over plain sequences (each node's parent the one before it, state0 zero), `chunk` nodes at a
    time in the WY/UT form: the training path (small chunks run fastest on a CPU). Returns out only. Shapes as
    above, leading batch dims allowed."""
    t = q.shape[-3]
    pad = (-t) % chunk
    q, k, v = (F.pad(x.transpose(-3, -2), (0, 0, 0, pad)).unflatten(-2, (-1, chunk)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(-2, -1), (0, pad)).unflatten(-1, (-1, chunk)) for x in (g, beta))  # [.., H, n, C]
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # node j -> node i
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    s = q.new_zeros(*q.shape[:-3], k.shape[-1], v.shape[-1])
    outs = []
    for i in range(q.shape[-3]):
        v_new = u[..., i, :, :] - w[..., i, :, :] @ s
        outs.append(q_decayed[..., i, :, :] @ s + intra[..., i, :, :] @ v_new)
        s = s * cum[..., i, -1, None, None].exp() + k_decayed[..., i, :, :].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=-3).flatten(-3, -2)[..., :t, :].transpose(-3, -2)


def tree_gated_delta_net(q, k, v, g, beta, parents, state0):
    """A `dtrt::TreeGatedDeltaNet` node during ONNX export (batch-free inputs); eagerly the Triton kernel
    or the reference (dtrt.ops.kernels)."""
    if q.dim() == 3:
        if torch.onnx.is_in_onnx_export():
            n, h, dk = q.shape
            return emit(
                "TreeGatedDeltaNet",
                (q, k, v, g, beta, parents, state0),
                (torch.float32, torch.float32),
                ((n, h, v.shape[-1]), (n, h, dk, v.shape[-1])),
            )
        if (run := kernel("tree_gated_delta_net", q, k, v, g, beta, state0)) is not None:
            return run(q, k, v, g, beta, parents, state0)
    return tree_gated_delta_net_ref(q, k, v, g, beta, parents, state0)

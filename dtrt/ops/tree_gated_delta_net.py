"""TreeGatedDeltaNet: the gated delta rule over tree nodes, each node continuing its parent's recurrent state.

q, k [N, H, dk] (L2-normalised, q also scaled by dk^-1/2), v [N, H, dv], g [N, H] (log decay, <= 0),
beta [N, H], parents [N] int64 (-1: the node continues state0), state0 [H, dk, dv], all fp32
-> out [N, H, dv], states [N, H, dk, dv] (the recurrent state after each node), fp32.

    S = exp(g_i) S_parent(i);   S += k_i (beta_i (v_i - k_i^T S))^T;   out_i = q_i^T S

Node i never sees a sibling's update, so verifying a tree gives every node the state of its own path, and a
commit takes the state of the last accepted node as it is. Leading batch dims are allowed (one parents for all).
"""

import onnxscript
import torch
import torch.nn.functional as F
from onnxscript import FLOAT, INT64
from onnxscript import opset20 as op

from dtrt.ops.base import OPSET, emit, register_function
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


@register_function
@onnxscript.script(OPSET, default_opset=op)
def TreeGatedDeltaNet(
    q: FLOAT, k: FLOAT, v: FLOAT, g: FLOAT, beta: FLOAT, parents: INT64, state0: FLOAT
) -> (FLOAT, FLOAT):
    one = op.Constant(value_int=1)
    n = op.Shape(q, start=0, end=1)
    # slot 0 holds state0, slot i+1 the state after node i: a node reads slot parent+1
    slots = op.Concat(
        op.Unsqueeze(state0, [0]),
        op.Expand(op.CastLike(op.Constant(value_float=0.0), state0), op.Concat(n, op.Shape(state0), axis=0)),
        axis=0,
    )
    outs = op.Expand(op.CastLike(op.Constant(value_float=0.0), v), op.Shape(v))
    for i in range(op.Squeeze(n)):
        at = op.Unsqueeze(i, [0])
        s = op.Gather(slots, op.Add(op.Gather(parents, i), one))  # [H, dk, dv]
        s = op.Mul(s, op.Unsqueeze(op.Exp(op.Gather(g, i)), [1, 2]))
        k_i = op.Unsqueeze(op.Gather(k, i), [2])  # [H, dk, 1]
        kv = op.ReduceSum(op.Mul(s, k_i), op.Constant(value_ints=[1]), keepdims=0)  # [H, dv]
        delta = op.Mul(op.Sub(op.Gather(v, i), kv), op.Unsqueeze(op.Gather(beta, i), [1]))
        s = op.Add(s, op.Mul(k_i, op.Unsqueeze(delta, [1])))
        o = op.ReduceSum(op.Mul(s, op.Unsqueeze(op.Gather(q, i), [2])), op.Constant(value_ints=[1]), keepdims=0)
        slots = op.ScatterND(slots, op.Unsqueeze(op.Add(at, one), [0]), op.Unsqueeze(s, [0]))
        outs = op.ScatterND(outs, op.Unsqueeze(at, [0]), op.Unsqueeze(o, [0]))
    states = op.Slice(slots, op.Constant(value_ints=[1]), op.Add(n, one), op.Constant(value_ints=[0]))
    return outs, states

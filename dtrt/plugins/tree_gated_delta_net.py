"""TreeGatedDeltaNet kernel: the gated delta rule over tree nodes, each node continuing its parent's state
(dtrt.ops.tree_gated_delta_net). q, k [N, H, dk], v [N, H, dv], g, beta [N, H], parents [N] int64,
state0 [H, dk, dv], fp32 -> out [N, H, dv], states [N, H, dk, dv].

One program per (head, block of dv columns) runs the nodes in order (parents precede children); a node reads
its parent's state back from the states output, which the same program wrote.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import next_pow2


@triton.jit
def tree_gated_delta_net_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    parents_ptr,
    state0_ptr,
    n_nodes,
    out_ptr,
    states_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < DK, vv < DV
    tile = k_ok[:, None] & v_ok[None, :]
    offs = kk[:, None] * DV + vv[None, :]
    s0 = tl.load(state0_ptr + h * DK * DV + offs, mask=tile, other=0.0)
    for i in range(n_nodes):
        at = i * H + h  # (node, head)
        p = tl.load(parents_ptr + i)
        if p >= 0:
            s = tl.load(states_ptr + (p * H + h) * DK * DV + offs, mask=tile, other=0.0)
        else:
            s = s0
        s = s * tl.exp(tl.load(g_ptr + at))
        k_i = tl.load(k_ptr + at * DK + kk, mask=k_ok, other=0.0)
        kv = tl.sum(s * k_i[:, None], axis=0)
        delta = (tl.load(v_ptr + at * DV + vv, mask=v_ok, other=0.0) - kv) * tl.load(beta_ptr + at)
        s = s + k_i[:, None] * delta[None, :]
        tl.store(states_ptr + at * DK * DV + offs, s, mask=tile)
        q_i = tl.load(q_ptr + at * DK + kk, mask=k_ok, other=0.0)
        tl.store(out_ptr + at * DV + vv, tl.sum(s * q_i[:, None], axis=0), mask=v_ok)
        tl.debug_barrier()  # a later node may read this state back


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1
    block_v: int = 32


def config(heads: int, dk: int, dv: int) -> Launch:
    block_k = next_pow2(dk, 16)
    block_v = max(16, min(next_pow2(dv), 4096 // block_k))
    return Launch({"H": heads, "DK": dk, "DV": dv, "BLOCK_K": block_k, "BLOCK_V": block_v}, block_v=block_v)


SIGNATURE = {
    "q_ptr": "*fp32",
    "k_ptr": "*fp32",
    "v_ptr": "*fp32",
    "g_ptr": "*fp32",
    "beta_ptr": "*fp32",
    "parents_ptr": "*i64",
    "state0_ptr": "*fp32",
    "n_nodes": "i32",
    "out_ptr": "*fp32",
    "states_ptr": "*fp32",
}


def run(q, k, v, g, beta, parents, state0):
    n, heads, dk = q.shape
    dv = v.shape[-1]
    launch = config(heads, dk, dv)
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=q.device)
    states = torch.empty(n, heads, dk, dv, dtype=torch.float32, device=q.device)
    args = [t.float().contiguous() for t in (q, k, v, g, beta)]
    tree_gated_delta_net_kernel[(heads, triton.cdiv(dv, launch.block_v))](
        *args,
        parents.contiguous(),
        state0.float().contiguous(),
        n,
        out,
        states,
        **launch.constexprs,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out, states

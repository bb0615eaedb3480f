"""TopMCorrectedScore kernel: DominoTree's corrected log-probs over the M candidates of one depth
(dtrt.ops.topm_corrected_score). zproj [bs, E] fp32, states [bs, n, G], w1s [E, G] (model dtype),
basec [bs, M] fp32, w2c [bs, M, E] fp32 -> [bs, n, M] fp32.

One program per (node, request): W1s . s accumulated in fp32 and rounded to the model dtype as the
reference's matmul is, SiLU, the M corrected logits in blocks with a running log-sum-exp, then a second
pass over the written row subtracts it.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dtrt.plugins.ptx import TRITON_TYPES, next_pow2


@triton.jit
def topm_corrected_score_kernel(
    zproj_ptr,
    states_ptr,
    w1s_ptr,
    basec_ptr,
    w2c_ptr,
    n_nodes,
    out_ptr,
    E: tl.constexpr,
    G: tl.constexpr,
    M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    row = b * n_nodes + node
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros([BLOCK_E], tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        g_ok = g < G
        s = tl.load(states_ptr + row * G + g, mask=g_ok, other=0.0).to(w1s_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w1s_ptr + e[:, None] * G + g[None, :], mask=e_ok[:, None] & g_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * s[None, :], axis=1)
    x = tl.load(zproj_ptr + b * E + e, mask=e_ok, other=0.0) + acc.to(w1s_ptr.dtype.element_ty).to(tl.float32)
    h = tl.where(e_ok, x * tl.sigmoid(x), 0.0)

    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # per-lane online log-sum-exp
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < M
        w2 = tl.load(w2c_ptr + (b * M + m[:, None]) * E + e[None, :], mask=m_ok[:, None] & e_ok[None, :], other=0.0)
        c = tl.load(basec_ptr + b * M + m, mask=m_ok, other=0.0) + tl.sum(w2 * h[None, :], axis=1)
        c = tl.where(m_ok, c, float("-inf"))
        tl.store(out_ptr + row * M + m, c, mask=m_ok)
        new_max = tl.maximum(run_max, c)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(c - safe)
        run_max = new_max
    top = tl.max(run_max, 0)
    lse = top + tl.log(tl.sum(tl.where(run_max == float("-inf"), 0.0, run_sum * tl.exp(run_max - top)), 0))
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < M
        c = tl.load(out_ptr + row * M + m, mask=m_ok, other=0.0)
        tl.store(out_ptr + row * M + m, c - lse, mask=m_ok)


@dataclass(frozen=True)
class Launch:
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 1


def config(emb: int, gru: int, topm: int) -> Launch:
    block_e = next_pow2(emb, 16)
    budget = 8192  # elements of one [BLOCK_E, BLOCK_G] or [BLOCK_M, BLOCK_E] tile
    return Launch(
        {
            "E": emb,
            "G": gru,
            "M": topm,
            "BLOCK_E": block_e,
            "BLOCK_G": max(16, min(next_pow2(gru), budget // block_e)),
            "BLOCK_M": max(16, min(next_pow2(topm), budget // block_e)),
        },
        num_warps=8 if block_e >= 256 else 4,
    )


def signature(state_dtype: torch.dtype) -> dict[str, str]:
    s = TRITON_TYPES[state_dtype]
    return {
        "zproj_ptr": "*fp32",
        "states_ptr": f"*{s}",
        "w1s_ptr": f"*{s}",
        "basec_ptr": "*fp32",
        "w2c_ptr": "*fp32",
        "n_nodes": "i32",
        "out_ptr": "*fp32",
    }


def run(zproj, states, w1s, basec, w2c) -> torch.Tensor:
    bs, n, gru = states.shape
    emb, topm = w1s.shape[0], basec.shape[-1]
    launch = config(emb, gru, topm)
    out = torch.empty(bs, n, topm, dtype=torch.float32, device=states.device)
    states = states.to(w1s.dtype).contiguous()
    topm_corrected_score_kernel[(n, bs)](
        zproj.float().contiguous(),
        states,
        w1s.contiguous(),
        basec.float().contiguous(),
        w2c.float().contiguous(),
        n,
        out,
        **launch.constexprs,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out

"""The dtrt ops as TensorRT plugins, through TensorRT's Python plugin API (tensorrt.plugin).

Each op is registered as `dtrt::<Name>`, version 1: the name, version and namespace the ONNX parser looks up
for a node `<Name>` of domain `dtrt`, so the parser takes the plugin instead of the node's function body.
Only ahead-of-time implementations are given: at build time the Triton kernel is compiled to PTX for the
build GPU with the launch grid as shape expressions, and TensorRT embeds both in the plan. Attributes
(LedgerSelect's budget and mask token) are compiled into the kernel, as AOT plugins do not serialize them.
"""

import torch

from dtrt.errors import DtrtError
from dtrt.plugins import NAMESPACE

_registered: dict = {}  # compute capability the AOT implementations compile for


def _dims(desc, *axes: int) -> list[int]:
    """Build-time constant dims of a tensor (its concrete shape where known, else constant shape expressions)."""
    out = []
    for a in axes:
        d = desc.shape[a] if desc.has_shape else -1
        if d < 0:
            expr = desc.shape_expr[a]
            if expr.is_fake or not expr.is_constant:
                raise ValueError(f"dim {a} of a {desc.dtype} input must be fixed when the engine is built")
            d = expr.constant_value()
        out.append(int(d))
    return out


def register_plugins(compute_capability: str):
    """Register every dtrt plugin in this process (once), compiling kernels for sm<compute_capability>."""
    if _registered:
        if _registered["cc"] != compute_capability:
            raise DtrtError(
                f"the dtrt plugins are registered for sm {_registered['cc']} in this process, not "
                f"{compute_capability}; build for one GPU per process"
            )
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dtrt.plugins import ledger_select as ls
    from dtrt.plugins import topm_corrected_score as tm
    from dtrt.plugins import tree_attention as ta
    from dtrt.plugins import tree_causal_conv1d as cv
    from dtrt.plugins import tree_gated_delta_net as gd
    from dtrt.plugins.ptx import compile_ptx

    torch_types = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int64: torch.int64,
        trt.int32: torch.int32,
        trt.bool: torch.bool,
    }
    Desc = trtp.TensorDesc
    Aot = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]

    def launch(kernel, sig: dict, cfg, grid: tuple, scalars: tuple):
        name, ptx, shared = compile_ptx(kernel, sig, cfg.constexprs, cfg.num_warps, cfg.num_stages, compute_capability)
        params = trtp.KernelLaunchParams()
        params.grid_x = grid[0]
        if len(grid) > 1:
            params.grid_y = grid[1]
        params.block_x = cfg.num_warps * 32
        params.shared_mem = shared
        extra = trtp.SymIntExprs(len(scalars))
        for i, s in enumerate(scalars):
            extra[i] = trtp.SymInt32(s)
        return name, ptx, params, extra

    # TreeAttention: q [H, N, hd], k, v [KVH, M, hd], mask [N, M] -> [H, N, hd]
    @trtp.register(f"{NAMESPACE}::TreeAttention")
    def tree_attention(q: Desc, k: Desc, v: Desc, mask: Desc) -> tuple[Desc]:
        return q.like()

    @trtp.aot_impl(f"{NAMESPACE}::TreeAttention")
    def tree_attention_aot(q: Desc, k: Desc, v: Desc, mask: Desc, outputs: tuple[Desc], tactic: int) -> Aot:
        heads, head_dim = _dims(q, 0, 2)
        (kv_heads,) = _dims(k, 0)
        cfg = ta.config(head_dim, heads // kv_heads, torch_types[q.dtype])
        return launch(
            ta.tree_attention_kernel,
            ta.signature(torch_types[q.dtype]),
            cfg,
            (trtp.cdiv(q.shape_expr[1], cfg.block_n), heads),
            (q.shape_expr[1], k.shape_expr[1]),
        )

    # TopMCorrectedScore: zproj [bs, E], states [bs, n, G], w1s [E, G], basec [bs, M], w2c [bs, M, E] -> [bs, n, M]
    @trtp.register(f"{NAMESPACE}::TopMCorrectedScore")
    def topm_corrected_score(zproj: Desc, states: Desc, w1s: Desc, basec: Desc, w2c: Desc) -> tuple[Desc]:
        s = states.shape_expr
        return trtp.from_shape_expr((s[0], s[1], basec.shape_expr[1]), dtype=trt.float32)

    @trtp.aot_impl(f"{NAMESPACE}::TopMCorrectedScore")
    def topm_corrected_score_aot(
        zproj: Desc, states: Desc, w1s: Desc, basec: Desc, w2c: Desc, outputs: tuple[Desc], tactic: int
    ) -> Aot:
        emb, gru = _dims(w1s, 0, 1)
        (topm,) = _dims(basec, 1)
        cfg = tm.config(emb, gru, topm)
        return launch(
            tm.topm_corrected_score_kernel,
            tm.signature(torch_types[w1s.dtype]),
            cfg,
            (states.shape_expr[1], states.shape_expr[0]),
            (states.shape_expr[1],),
        )

    # LedgerSelect: scores, tokens, parents [bs, D, Wk], root [bs] -> tokens, parents, depths, scores [bs, N],
    # mask [bs, N, N]
    @trtp.register(f"{NAMESPACE}::LedgerSelect")
    def ledger_select(
        scores: Desc, tokens: Desc, parents: Desc, root: Desc, budget: int, mask_token_id: int
    ) -> tuple[Desc, Desc, Desc, Desc, Desc]:
        bs, n = scores.shape_expr[0], budget + 1
        rows = [trtp.from_shape_expr((bs, n), dtype=t) for t in (trt.int64, trt.int64, trt.int64, trt.float32)]
        return (*rows, trtp.from_shape_expr((bs, n, n), dtype=trt.bool))

    @trtp.aot_impl(f"{NAMESPACE}::LedgerSelect")
    def ledger_select_aot(
        scores: Desc,
        tokens: Desc,
        parents: Desc,
        root: Desc,
        budget: int,
        mask_token_id: int,
        outputs: tuple[Desc],
        tactic: int,
    ) -> Aot:
        depth, wk = _dims(scores, 1, 2)
        cfg = ls.config(depth, wk, budget, mask_token_id)
        return launch(ls.ledger_select_kernel, ls.SIGNATURE, cfg, (scores.shape_expr[0],), ())

    # TreeGatedDeltaNet: q, k [N, H, dk], v [N, H, dv], g, beta [N, H], parents [N], state0 [H, dk, dv]
    # -> out [N, H, dv], states [N, H, dk, dv]
    @trtp.register(f"{NAMESPACE}::TreeGatedDeltaNet")
    def tree_gated_delta_net(
        q: Desc, k: Desc, v: Desc, g: Desc, beta: Desc, parents: Desc, state0: Desc
    ) -> tuple[Desc, Desc]:
        n, h, dk = (q.shape_expr[i] for i in range(3))
        return (v.like(), trtp.from_shape_expr((n, h, dk, v.shape_expr[2]), dtype=trt.float32))

    @trtp.aot_impl(f"{NAMESPACE}::TreeGatedDeltaNet")
    def tree_gated_delta_net_aot(
        q: Desc, k: Desc, v: Desc, g: Desc, beta: Desc, parents: Desc, state0: Desc, outputs: tuple[Desc], tactic: int
    ) -> Aot:
        heads, dk = _dims(q, 1, 2)
        (dv,) = _dims(v, 2)
        cfg = gd.config(heads, dk, dv)
        return launch(
            gd.tree_gated_delta_net_kernel, gd.SIGNATURE, cfg, (heads, -(-dv // cfg.block_v)), (q.shape_expr[0],)
        )

    # TreeCausalConv1d: x [N, C], parents [N], conv_state [C, K-1], weight [C, K] -> out [N, C], windows [N, C, K-1]
    @trtp.register(f"{NAMESPACE}::TreeCausalConv1d")
    def tree_causal_conv1d(x: Desc, parents: Desc, conv_state: Desc, weight: Desc) -> tuple[Desc, Desc]:
        s = x.shape_expr
        return (x.like(), trtp.from_shape_expr((s[0], s[1], conv_state.shape_expr[1]), dtype=x.dtype))

    @trtp.aot_impl(f"{NAMESPACE}::TreeCausalConv1d")
    def tree_causal_conv1d_aot(
        x: Desc, parents: Desc, conv_state: Desc, weight: Desc, outputs: tuple[Desc], tactic: int
    ) -> Aot:
        channels, kernel = _dims(weight, 0, 1)
        cfg = cv.config(channels, kernel)
        sig = cv.signature(torch_types[x.dtype], torch_types[conv_state.dtype], torch_types[weight.dtype])
        return launch(
            cv.tree_causal_conv1d_kernel, sig, cfg, (x.shape_expr[0], -(-channels // cfg.block_c)), (x.shape_expr[0],)
        )

    _registered["cc"] = compute_capability


def registered_plugins() -> list[str]:
    """`namespace::name` of the dtrt plugins TensorRT's registry holds in this process."""
    import tensorrt as trt

    from dtrt.plugins import OPS, PLUGIN_VERSION

    registry = trt.get_plugin_registry()
    return [f"{NAMESPACE}::{op}" for op in OPS if registry.get_creator(op, PLUGIN_VERSION, NAMESPACE) is not None]

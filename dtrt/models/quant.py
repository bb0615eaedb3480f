"""Weight-only quantization of a target's linear layers: the one definition of the quantized weights that the
exporter writes into the graph and that the PyTorch reference (`dtrt parity`, `dtrt quality`, the torch backend on
a quantized export) multiplies by.

    int8   per output channel:  W[o, :] = q[o, :] * scale[o]
    int4   per block of `block` input features:  W[o, b*block:(b+1)*block] = q[o, ...] * scale[o, b]

Symmetric (no zero point: TensorRT's INT4 dequantize takes none) and deterministic. The scale of each channel or
block is chosen among `CLIP_RATIOS` of its absolute maximum, the one whose round-to-nearest reconstruction has the
least squared error (`method="mse"`), or is the absolute maximum itself (`method="rtn"`, the default: on SmolLM2's
int4 target the clipped scales lower the weights' error but raise the held-out NLL, 2.234 against 2.213 nats per
token). Both are pure functions of the weights: export and reference compute the same integers and scales, bit for
bit.

    gguf, gguf-a8   the blocks of the GGUF file the checkpoint was converted from, kept as the file holds them
                    (GgufQuant; dtrt.models.gguf_blocks, dtrt.exporter.gguf_target)
"""

import copy

import torch
from torch import nn

from dtrt.models.quant_spec import GgufQuant, QuantSpec

CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(9))  # 1.0 down to 0.8
QMAX = {8: 127, 4: 7}
QMIN = {8: -128, 4: -8}


def _groups(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w [out, in] as [out, groups, size]: one group per channel (int8) or per block (int4, zero-padded)."""
    out, k = w.shape
    size = k if spec.block is None else spec.block
    pad = -k % size
    if pad:
        w = torch.cat((w, w.new_zeros(out, pad)), dim=1)
    return w.reshape(out, -1, size)


def quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (q int8 [out, in] in [QMIN, QMAX], scale [out, groups] in w's dtype)."""
    rows = max(1, CHUNK // w.shape[1])
    parts = [_quantize_rows(w[i : i + rows], spec) for i in range(0, w.shape[0], rows)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


CHUNK = 1 << 24  # weights per piece of quantize(): bounds the temporaries of a large lm_head


def _quantize_rows(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    k = w.shape[1]
    g = _groups(w.detach().float(), spec)
    qmax, qmin = QMAX[spec.bits], QMIN[spec.bits]
    absmax = g.abs().amax(-1, keepdim=True)
    best_scale = best_err = None
    for r in CLIP_RATIOS if spec.method == "mse" else (1.0,):
        scale = (absmax * r / qmax).to(w.dtype).float()  # the scale as stored, so the error is the one served
        q = torch.clamp(torch.round(g / torch.where(scale > 0, scale, 1.0)), qmin, qmax)
        err = (q.mul_(scale).sub_(g)).square_().sum(-1, keepdim=True)
        if best_err is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale, best_err = torch.where(better, scale, best_scale), torch.minimum(err, best_err)
    q = torch.clamp(torch.round(g / torch.where(best_scale > 0, best_scale, 1.0)), qmin, qmax).to(torch.int8)
    return q.reshape(w.shape[0], -1)[:, :k].contiguous(), best_scale[..., 0].to(w.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The weights [out, in] the quantized graph multiplies by: q * scale in the scale's dtype, as DequantizeLinear
    computes them."""
    k = q.shape[1]
    size = k if spec.block is None else spec.block
    s = scale.repeat_interleave(size, dim=1)[:, :k]
    return q.to(scale.dtype) * s


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers a quantized export quantizes: every nn.Linear of the target, the lm_head included (tied or
    not), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def weight_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Every quantized linear's weight by all the names it has in the model's state (a tied weight has several; an
    exported graph calls its initializer by one of them)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    groups = {id(m.weight): tuple(names[id(m.weight)]) for m in quantized_linears(model).values()}
    return list(groups.values())


@torch.no_grad()
def dequantized(model: nn.Module, spec: "QuantSpec | GgufQuant | None") -> nn.Module:
    """The PyTorch reference of a quantized export: a copy of `model` whose quantized linears multiply by their
    dequantized weights. Every other tensor is shared with `model`, which is unchanged (a drafter stage built on its
    lm_head keeps the full-precision one); a tied lm_head is untied, the embedding stays full precision. A GgufQuant
    target's weights are the checkpoint's own: `model` itself."""
    if spec is None or isinstance(spec, GgufQuant):
        return model
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo)
    for m in quantized_linears(clone).values():
        q, scale = quantize(m.weight, spec)
        m.weight = nn.Parameter(dequantize(q, scale, spec), requires_grad=False)
    return clone

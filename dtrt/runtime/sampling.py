"""The target's choice at every tree node: argmax at T=0, else a sample with temperature and top-p."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

NUCLEUS_FIRST_K = 64  # the nucleus is looked for among this many top tokens first, then 4x as many, ...


@dataclass(frozen=True)
class SamplingConfig:
    """The target's sampling (checked where a request is made: dtrt.frontend.requests.make_request)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def target_probs(logits, temperature: float, top_p: float):
    """Probabilities [N, V] after temperature and nucleus (top-p) filtering, fp32."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def nucleus(probs, top_p: float):
    """(mass, ids): the top-p nucleus of probabilities [V] as target_probs keeps it, unnormalised: with top_p 1 the
    probabilities themselves and ids None; else the top k (the top 64 when they hold top_p of the mass, else 4x as
    many, up to the whole vocabulary, so the common case never sorts the vocabulary) with the tokens past the nucleus
    zeroed, and their token ids."""
    if top_p >= 1.0:
        return probs, None
    k = NUCLEUS_FIRST_K
    while True:
        top, ids = probs.topk(min(k, probs.numel()))
        if top.sum() >= top_p or k >= probs.numel():
            break
        k *= 4
    return top.masked_fill(top.cumsum(0) - top >= top_p, 0.0), ids  # mass strictly before a token reaches top_p


def draw(row, temperature: float, top_p: float, generator: torch.Generator | None = None) -> int:
    """One sample from target_probs(row) for a row of logits [V], by inverting the cumulative mass at one uniform
    draw (a multinomial over the vocabulary draws a random number per token)."""
    mass, ids = nucleus(torch.softmax(row.float() / temperature, dim=-1), top_p)
    cdf = mass.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=cdf.device) * cdf[-1]
    # the first token whose cumulative mass passes u: a token of zero mass never is
    j = min(int(torch.searchsorted(cdf, u.reshape(1), right=True)), cdf.numel() - 1)
    return j if ids is None else int(ids[j])


def chooser(logits, cfg: SamplingConfig, generator: torch.Generator | None = None) -> Callable[[int], int]:
    """The target's token after tree node i, for `dtrt.tree.tree.accept`. At T>0 a node is sampled only when the
    acceptance walk reaches it: a round makes one draw per token it commits, as AR makes one per step, so with the
    same seed a speculative method commits AR's very tokens wherever its logits are AR's, and a big tree costs no
    more sampling than a chain."""
    if cfg.temperature == 0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy's: the first of equals, as torch's
            return logits.numpy().argmax(-1).tolist().__getitem__
        return logits.argmax(-1).tolist().__getitem__
    return lambda i: draw(logits[i], cfg.temperature, cfg.top_p, generator)

"""The target's choice at every tree node: argmax at T=0, else a sample with temperature and top-p."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """The target's sampling (checked where a request is made: dtrt.runtime.requests.make_request)."""

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


def choose(logits, cfg: SamplingConfig, generator: torch.Generator | None = None):
    """Long[N]: the target's token at each row of `logits` [N, V]."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, cfg.temperature, cfg.top_p), 1, generator=generator).squeeze(-1)

"""The target's choice at every tree node: argmax at T=0, else a sample with temperature and top-p.

At T>0 the token at sequence position p is drawn with the uniform u[p] of the generation's seed (`Draws`), under
every method and backend: a draw is one uniform that inverts the target's cumulative probabilities. Keyed by
position, the draws do not depend on how many nodes a round samples nor in which order, so a round can sample every
node of its tree at once on the device (`draw_rows`: each node's token lands at a position known from its depth)
and still commit, with the same seed, AR's very tokens wherever its logits are AR's; the host walk samples only the
nodes it reaches (`draw`), one draw per committed token.
"""

from collections.abc import Callable

import numpy as np
import torch

from dtrt.runtime.request_values import SamplingConfig

NUCLEUS_FIRST_K = 64  # the nucleus is looked for among this many top tokens first, then 4x as many, ...


def uniforms(seed: int, n: int) -> np.ndarray:
    """float64 [n] in [0, 1): the uniform of each sequence position 0..n-1 under `seed`. One PCG64 stream per seed,
    so a longer table begins with a shorter one's values."""
    return np.random.Generator(np.random.PCG64(seed)).random(n)


class Draws:
    """A T>0 generation's sampling: its config and the uniforms of its seed, one per sequence position, grown on
    demand."""

    def __init__(self, cfg: SamplingConfig, n: int):
        self.cfg = cfg
        self.u = uniforms(cfg.seed, n)

    def table(self, n: int) -> np.ndarray:
        """The uniforms of positions 0..n-1 at least."""
        if n > len(self.u):
            self.u = uniforms(self.cfg.seed, max(n, 2 * len(self.u)))
        return self.u

    def at(self, position: int) -> float:
        return float(self.table(position + 1)[position])

    def draw(self, row, position: int) -> int:
        """The token at `position`, drawn from the row of logits [V] before it."""
        return draw(row, self.cfg.temperature, self.cfg.top_p, self.at(position))


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


def ranked(top: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, ids) ordered by probability, descending, equal probabilities by token id: the order of a stable
    descending sort of the vocabulary, which draw_rows uses (topk leaves the order of ties open)."""
    ids, by_id = ids.sort()
    top, order = top[by_id].sort(descending=True, stable=True)
    return top, ids[order]


def straddles(top, k: int, top_p: float) -> bool:
    """Whether the k-th most likely token ties with the next one (top: the top k + 1 probabilities, descending) and
    that tied group can reach the nucleus: which of its tokens are in then depends on the order of equals (a token
    of zero mass is never drawn)."""
    last, after = top[k - 1 : k + 1].tolist()
    if last == 0.0 or after != last:
        return False
    first = k - int((top[:k] == last).sum())  # the group's first rank: the mass before it, as the nucleus counts it
    return float(top[: first + 1].cumsum(0)[first] - top[first]) < top_p


def nucleus(probs, top_p: float):
    """(mass, ids): the top-p nucleus of probabilities [V] as target_probs keeps it, unnormalised: with top_p 1 the
    probabilities themselves and ids None; else the top k in `ranked` order with the tokens past the nucleus zeroed,
    and their token ids. k is 64 when those hold top_p of the mass, else 4x as many, up to the whole vocabulary, so
    the common case never sorts the vocabulary; k grows too where the k-th token ties with the next and that tie
    reaches into the nucleus (which of the equals are in is then decided by token id, as the whole sort decides)."""
    if top_p >= 1.0:
        return probs, None
    k = NUCLEUS_FIRST_K
    while k < probs.numel():
        top, ids = probs.topk(k + 1)
        if top[:k].sum() >= top_p and not straddles(top, k, top_p):
            top, ids = top[:k], ids[:k]
            break
        k *= 4
    else:
        top, ids = probs.topk(probs.numel())
    top, ids = ranked(top, ids)
    return top.masked_fill(top.cumsum(0) - top >= top_p, 0.0), ids  # mass strictly before a token reaches top_p


def pick(cdf, point):
    """The first index whose cumulative mass `cdf` passes `point` (u times the total; both [..., 1]), so a token of
    zero mass never is; where u times the total rounds up to the total, the last token with mass."""
    return torch.minimum(
        torch.searchsorted(cdf, point, right=True), torch.searchsorted(cdf, cdf[..., -1:].contiguous())
    )


def draw(row, temperature: float, top_p: float, u: float) -> int:
    """One sample from target_probs(row) for a row of logits [V], with u, a uniform in [0, 1)."""
    mass, ids = nucleus(torch.softmax(row.float() / temperature, dim=-1), top_p)
    cdf = mass.double().cumsum(0)
    j = int(pick(cdf, cdf[-1:] * u))
    return j if ids is None else int(ids[j])


def draw_rows(logits, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, *, nucleus: bool):
    """`draw` at every row of logits [W, V] at once, row i with uniform u[i] (float64 [W]), as tensor operations
    with no host value: temperature and top_p are device scalars, `nucleus` says whether top_p filters (top_p < 1).
    The vocabulary is sorted (stably, so equal probabilities go by token id, as `ranked`) only under a nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ids = None
    if nucleus:
        probs, ids = probs.sort(dim=-1, descending=True, stable=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    j = pick(cdf, (cdf[:, -1] * u)[:, None])
    return (j if ids is None else ids.gather(-1, j))[:, 0]


def chooser(logits, draws: Draws | None = None, position: Callable[[int], int] | None = None) -> Callable[[int], int]:
    """The target's token after tree node i, for `dtrt.tree.tree.accept`: argmax without `draws` (T=0), else drawn
    at `position(i)`, the position of the token after node i. A node is sampled only when the acceptance walk reaches
    it, so a big tree costs no more sampling than a chain."""
    if draws is None:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy's: the first of equals, as torch's
            return logits.numpy().argmax(-1).tolist().__getitem__
        return logits.argmax(-1).tolist().__getitem__
    return lambda i: draws.draw(logits[i], position(i))

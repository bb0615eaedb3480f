"""A backend with no model behind it, for loop and method tests that run in milliseconds.

The "target" is a fixed rule: after token t comes (5 t + 3) mod V, so its choice at a tree node depends only on
the node's own token and every tree is verified consistently. The "drafter" proposes that chain from the root, and
by the round's start position it is right at every depth, or wrong at one depth with the right token second (chains
stop there, trees go on through the sibling), or wrong with the right token out of every top-k (trees stop too),
so rounds with all, some and no drafts accepted occur."""

from dataclasses import dataclass

import torch

from dtrt.runtime.backends.base import Backend
from dtrt.runtime.methods import make_method
from dtrt.runtime.pipeline import Pipeline
from dtrt.runtime.spec import RunSpec
from dtrt.tree import MarginalScorer, build_frontier

V, D = 32, 4


def successor(t: int) -> int:
    return (5 * t + 3) % V


@dataclass(frozen=True)
class FakeDrafterDims:
    block_size: int = D + 1
    k_draft: int = D
    mask_token_id: int = V - 1
    pure_draft_prefix_len: int = 1
    target_layer_ids: tuple = (0,)


@dataclass(frozen=True)
class FakeDrafter:
    cfg: FakeDrafterDims = FakeDrafterDims()


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, max_context: int | None = None):
        self.device = torch.device("cpu")
        self.drafter = FakeDrafter()
        self.max_context, self.context_source = max_context, "the fake's context"
        self.committed: list[int] = []
        self._last: list[int] = []
        self.cap = 0
        self.calls = {"target_forward": 0, "draft_block": 0}

    def reset(self, capacity: int):
        self.committed, self.cap = [], capacity

    @property
    def past(self) -> int:
        return len(self.committed)

    @property
    def capacity(self) -> int:
        return self.cap

    def target_forward(self, ids, positions, mask):
        self.calls["target_forward"] += 1
        ids = torch.as_tensor(ids).tolist()
        assert len(self.committed) + len(ids) <= self.cap, "over the reset capacity"
        logits = torch.zeros(len(ids), V)
        for i, t in enumerate(ids):
            logits[i, successor(t)] = 10.0
        self._last = ids
        return logits, torch.zeros(len(ids), 1)

    def commit(self, accepted):
        self.committed += [self._last[i] for i in torch.as_tensor(accepted).tolist()]

    def draft_context(self, hidden, positions):
        assert len(hidden) == len(positions)

    def draft_block(self, root: int, start: int, *, rows: int):
        self.calls["draft_block"] += 1
        base = torch.zeros(D, V)
        mode, wrong = (start // 2) % 3, start % D  # mode 0: every draft right
        t = root
        for d in range(D):
            t = successor(t)
            base[d, t] = 5.0
            if mode and d == wrong:
                base[d, (t + 1) % V] = 6.0
                base[d, t] = 5.0 if mode == 1 else -5.0
        return torch.zeros(rows, 1), base[:rows]

    def scorer(self, arm, rnd, k, topm):
        return MarginalScorer(rnd, k)  # no Domino head: every arm scores the marginals

    def domino_chain(self, rnd):
        return rnd.base[0].argmax(-1)  # no Domino head: the marginal argmax

    def frontier(self, rnd, budget, arm, k, topm, max_depth):
        return build_frontier(self.scorer(arm, rnd, k, topm), budget, max_depth, self.drafter.cfg.mask_token_id)

    def time_verify(self, n: int, past: int):
        pass


class FakeTokenizer:
    """Token t is the letter t mod 26."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)

    def encode(self, text, add_special_tokens=False, verbose=False):
        return [ord(c) - 97 for c in text]


def fake_pipeline(method: str = "dominotree", eos: tuple[int, ...] = (), max_context=None, **spec) -> Pipeline:
    run = RunSpec(method=method, **spec)
    return Pipeline(FakeBackend(max_context), make_method(run), run, FakeTokenizer(), eos)

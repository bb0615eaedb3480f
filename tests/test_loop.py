"""The decode loop as a stream of rounds and every method on it, driven by the fake backend (milliseconds). The
real-model tests (test_methods.py, test_ort_backend.py) are what prove acceptance on trained drafters."""

import pytest
import torch
from fake_backend import FakeBackend, fake_pipeline, successor

from dtrt.frontend.text import complete
from dtrt.runtime.generate import Generation, collect
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import CostCurve

LINEAR_COST = CostCurve.fit({0: [(0, 1.0), (32, 2.0)]}, draft_cost=0.5)
PROMPT = [1, 2, 3]


def ar_chain(n: int, last: int = PROMPT[-1]) -> list[int]:
    out = []
    for _ in range(n):
        last = successor(last)
        out.append(last)
    return out


def test_the_stream_yields_the_prefill_token_then_one_step_per_round():
    pipe = fake_pipeline("dominotree", budget=6)
    steps = list(pipe.stream(PROMPT, 20, SamplingConfig()))
    assert steps[0].stats is None and steps[0].tokens == ar_chain(1) and steps[0].prefill_s > 0
    assert all(s.stats is not None and 1 <= len(s.tokens) <= s.stats.accepted for s in steps[1:])
    assert [s.end for s in steps] == [None] * (len(steps) - 1) + ["length"]
    assert sum((s.tokens for s in steps), []) == ar_chain(20)
    g = Generation()
    for s in steps:
        g.add(s)
    assert g.tokens == ar_chain(20) and len(g.rounds) == len(steps) - 1 and g.stop_reason == "length"


SPECS = [
    ("ar", {}),
    ("dflash", {}),
    ("domino", {}),
    ("ddtree", {"budget": 6}),
    ("caddtree", {"budget": 12}),
    ("dominotree", {"budget": 6}),
    ("dominotree", {"budget": 6, "builder": "frontier"}),
    ("dominotree", {"budget": 3, "node_topk": 2, "arm": "marg"}),
    ("cadominotree", {"budget": 12}),
]


@pytest.mark.parametrize("method,fields", SPECS, ids=[f"{m}-{'-'.join(map(str, f.values()))}" for m, f in SPECS])
def test_every_method_gives_the_ar_tokens_on_the_fake(method, fields):
    pipe = fake_pipeline(method, **fields)
    if method.startswith("ca"):
        pipe.method.curve = LINEAR_COST
    g = pipe.generate(PROMPT, 40, SamplingConfig())
    assert g.tokens == ar_chain(40)
    accepted = [r.accepted for r in g.rounds]
    if method == "ar":
        assert set(accepted) == {1}
    else:
        assert g.tau > 1.5, accepted
        depth = pipe.backend.drafter.cfg.k_draft
        full = min(depth, pipe.spec.budget if method in ("ddtree", "dominotree") else depth) + 1
        assert max(accepted) == full, accepted  # all drafts accepted
        assert full < depth + 1 or min(accepted) < full, accepted  # and not all, where the tree reaches the mistakes


def test_eos_and_max_new_tokens_cut_a_round():
    eos = ar_chain(9)[-1]
    g = fake_pipeline("dominotree", eos=(eos,)).generate(PROMPT, 40, SamplingConfig())
    assert g.tokens == ar_chain(9) and g.stop_reason == "eos"
    for n in (1, 2, 7):
        g = fake_pipeline("dominotree").generate(PROMPT, n, SamplingConfig())
        assert g.tokens == ar_chain(n) and g.stop_reason == "length"


def test_sampling_draws_the_targets_tokens_and_repeats_with_a_seed():
    # the fake target puts almost all mass on one token: sampled runs follow the chain and agree with themselves
    pipe = fake_pipeline("dominotree")
    a, b = (pipe.generate(PROMPT, 30, SamplingConfig(1.0, 0.9, 7)).tokens for _ in range(2))
    assert a == b == ar_chain(30)


def test_a_consumer_ends_the_stream_and_the_loop_stops():
    pipe = fake_pipeline("dominotree", budget=6)
    text = pipe.tokenizer.decode(ar_chain(40))
    stop = text[17:20]
    c = complete(pipe, PROMPT, 40, SamplingConfig(), stop=(stop,))
    assert c.stop_reason == "stop" and c.text == text[: text.index(stop)]
    rounds = pipe.backend.calls["target_forward"]
    assert rounds == len(c.generation.rounds) + 1 < 40  # no round ran after the stop
    ticks = iter([False, False, True])
    c = complete(pipe, PROMPT, 40, SamplingConfig(), cancelled=lambda: next(ticks))
    assert c.stop_reason == "cancelled" and len(c.generation.rounds) == 2 and c.tokens == ar_chain(len(c.tokens))


def test_collect_is_the_whole_stream():
    pipe = fake_pipeline("ddtree", budget=4)
    g = collect(pipe.stream(PROMPT, 12, SamplingConfig()))
    assert g.tokens == ar_chain(12) and g.decode_s > 0 and g.tokens_per_s > 0


def test_the_loop_keeps_to_the_capacity_it_reset():
    backend = FakeBackend()
    pipe = fake_pipeline("dominotree", budget=8)
    pipe.backend = backend
    pipe.generate(list(range(50)), 30, SamplingConfig())
    assert backend.past <= backend.capacity
    assert torch.equal(torch.tensor(backend.committed[:50]), torch.arange(50))


def test_lookup_gives_the_ar_tokens_on_the_fake_with_right_partly_right_and_wrong_chains():
    # the stream's suffix 1 8 (8 chosen at prefill) matches at its start: 11 follows (the target's choice), then 0
    # (the target's is 26); later the target's own cycle repeats and is matched whole
    prompt = [1, 8, 11, 0, 1]
    pipe = fake_pipeline("lookup", budget=6)
    g = pipe.generate(prompt, 80, SamplingConfig())
    assert g.tokens == ar_chain(80, last=prompt[-1])
    assert pipe.backend.calls["draft_block"] == 0  # no drafter
    rounds = [(r.tree_size, r.accepted) for r in g.rounds]
    assert rounds[0] == (7, 2)  # partly right
    assert (1, 1) in rounds  # nothing matched: an AR step
    assert (7, 7) in rounds  # all right
    assert any(size == 7 and accepted == 1 for size, accepted in rounds), rounds  # wrong from the first token

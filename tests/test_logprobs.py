"""Logprobs from the decode loop: asked for, every committed token carries the target's log-probability (log_softmax
of the target's logits at that position, before temperature) and its top alternatives, equal to a plain forward of
the target over prompt + output; the tokens are the same as without them; a stop string cuts both alike."""

import pytest
import torch
from helpers import PROMPTS, pipe_for, spec

from dtrt.frontend.text import TokenPieces, complete
from dtrt.models.checkpoint import load_target
from dtrt.runtime.generate import collect
from dtrt.runtime.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tiny):
    return load_target(tiny.target)


@torch.no_grad()
def reference_logprobs(target, prompt: list[int], tokens: list[int]):
    """log_softmax of one causal forward over prompt + tokens, at the rows that chose each token: [len(tokens), V]."""
    ids = torch.tensor(prompt + tokens)
    n = len(ids)
    logits, _ = target(ids, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    return torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : n - 1]


@pytest.mark.parametrize("method", ["ar", "dominotree"])
def test_logprobs_are_the_targets(tiny, reference, method):
    pipe = pipe_for(tiny, spec(method))
    rounds = 0
    for prompt, temperature in zip(PROMPTS[:3], (0.0, 0.8, 1.2)):
        ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)
        sampling = SamplingConfig(temperature, seed=3)
        plain = pipe.generate(ids, 40, sampling)
        gen = collect(pipe.stream(ids, 40, sampling, logprobs=5))
        assert gen.tokens == plain.tokens  # asking for logprobs changes nothing else
        rounds += len(gen.rounds)
        assert len(gen.logprobs) == len(gen.tokens)
        ref = reference_logprobs(reference, ids, gen.tokens)
        chosen = ref.gather(-1, torch.tensor(gen.tokens)[:, None])[:, 0]
        got = torch.tensor([lp.logprob for lp in gen.logprobs])
        assert torch.allclose(got, chosen, atol=1e-4), (got - chosen).abs().max()
        top_v, top_i = ref.topk(5, -1)
        assert [[i for i, _ in lp.top] for lp in gen.logprobs] == top_i.tolist()
        got_v = torch.tensor([[v for _, v in lp.top] for lp in gen.logprobs])
        assert torch.allclose(got_v, top_v, atol=1e-4)
        if temperature == 0:  # greedy: every token is its row's most likely one
            assert all(lp.top[0][0] == t for lp, t in zip(gen.logprobs, gen.tokens))
    if method != "ar":
        assert rounds < 3 * 40  # rounds committed several tokens: the verify rows of accepted drafts were read


def test_logprobs_follow_a_stop_string_and_k0(tiny):
    pipe = pipe_for(tiny, spec("dominotree"))
    ids = pipe.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    full = complete(pipe, ids, 40, SamplingConfig(), logprobs=0)
    assert len(full.generation.logprobs) == len(full.tokens) and all(lp.top == () for lp in full.generation.logprobs)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = complete(pipe, ids, 40, SamplingConfig(), stop=(stop,), logprobs=0)
    assert cut.stop_reason == "stop" and len(cut.tokens) < len(full.tokens)
    assert cut.generation.logprobs == full.generation.logprobs[: len(cut.tokens)]
    with pytest.raises(ValueError, match="logprobs 21"):
        next(pipe.stream(ids, 4, SamplingConfig(), logprobs=21))


def test_token_pieces(tiny):
    from dtrt.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny.target)
    pieces = TokenPieces(tok)
    ids = tok.encode("The cat sees ", add_special_tokens=False)
    assert "".join(pieces(i)[0] for i in ids) == "The cat sees "
    assert all(bytes(pieces(i)[1]).decode() == pieces(i)[0] for i in ids)

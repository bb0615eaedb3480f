"""The prompt-lookup index (dtrt.tree.lookup) against a brute-force search on random token streams: the longest
matching suffix is found, every proposal is a real earlier continuation of it, the most recent first."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dtrt.tree.lookup import SCAN, LookupIndex


def brute_match(tokens: list[int], max_ngram: int) -> tuple[int, list[int]]:
    """The longest suffix (<= max_ngram) that also ends at an earlier position, and every such position."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            return n, ends
    return 0, []


def brute_continuation(tokens: list[int], end: int, max_len: int) -> list[int]:
    """The tokens after `end`, read one by one from the stream followed by what was read so far."""
    out: list[int] = []
    for j in range(end + 1, end + 1 + max_len):
        out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
    return out


streams = st.lists(st.integers(0, 3), max_size=60) | st.lists(st.integers(0, 20), max_size=60)


@settings(max_examples=300, deadline=None)
@given(streams, st.lists(st.integers(0, 6), max_size=5), st.integers(1, 6), st.integers(1, 9), st.integers(1, 4))
def test_the_index_finds_the_longest_match_and_proposes_its_earlier_continuations(
    tokens, cuts, max_ngram, max_len, alternatives
):
    index, pos = LookupIndex(max_ngram=max_ngram), 0
    for c in [*cuts, len(tokens)]:  # extended piece by piece, as tokens commit
        index.extend(tokens[pos : pos + c])
        pos = min(pos + c, len(tokens))
        stream = tokens[:pos]
        n, ends = brute_match(stream, max_ngram)
        assert index.match() == (n, ends)
        chains = index.propose(max_len=max_len, n_alternatives=alternatives)
        if n == 0:
            assert chains == []
            continue
        assert chains[0] == brute_continuation(stream, ends[-1], max_len)  # the most recent occurrence first
        real = {tuple(brute_continuation(stream, e, max_len)) for e in ends[-SCAN * alternatives :]}
        assert {tuple(c) for c in chains} <= real and len({tuple(c) for c in chains}) == len(chains)
        assert len(chains) == min(alternatives, len(real)) and all(len(c) == max_len for c in chains)


def test_no_repetition_proposes_nothing():
    index = LookupIndex(range(1000))
    assert index.match() == (0, []) and index.propose(max_len=8) == []
    index.extend([500, 501])
    assert index.match()[0] == 2 and index.propose(max_len=3) == [[502, 503, 504]]


def test_a_periodic_stream_proposes_its_period_on():
    index = LookupIndex([7, 1, 2, 3, 1, 2, 3, 1])
    assert index.propose(max_len=7) == [[2, 3, 1, 2, 3, 1, 2]]
    assert index.propose(max_len=2, n_alternatives=3) == [[2, 3]]


@settings(max_examples=300, deadline=None)
@given(streams, st.lists(st.tuples(st.integers(0, 60), streams), min_size=1, max_size=10), st.integers(1, 6))
def test_forks_match_a_fresh_build(tokens, forks, max_ngram):
    """A chain of forks (the prefix cache's turns: restore k positions, extend by new tokens), each left frozen, is
    the index a fresh build over the same stream is, and the indexes it forked from stay as they were."""
    index = LookupIndex(tokens, max_ngram=max_ngram)
    frozen = []
    for k, more in forks:
        before = (list(index.tokens), index.match(), index.propose(max_len=3, n_alternatives=2))
        frozen.append((index, before))
        index = index.fork(min(k, len(index)))
        index.extend(more)
        fresh = LookupIndex(index.tokens, max_ngram=max_ngram)
        assert index.match() == fresh.match() == brute_match(index.tokens, max_ngram)
        assert index.propose(max_len=5, n_alternatives=3) == fresh.propose(max_len=5, n_alternatives=3)
    for old, before in frozen:
        assert (old.tokens, old.match(), old.propose(max_len=3, n_alternatives=2)) == before

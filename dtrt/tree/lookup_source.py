"""Lookup as a second source of DominoTree's nodes (`--lookup`): per request, the index over its tokens
(dtrt.tree.lookup), the chains proposed each round as a trie, and a calibrated acceptance per draft depth.

A lookup node is verified when its parent is accepted; at depth d it is accepted with the running rate
(accepted + 1) / (verified + 2) of this request's verified lookup nodes at d (prior 0.5), so its path
probability is its parent's times that rate: log_accept[d] is what the heap builder adds to its parent's score."""

import math
from typing import Literal

from dtrt.tree.lookup import LookupIndex, index_over
from dtrt.tree.lookup_scorer import LookupScorer, Trie
from dtrt.tree.tree import Tree

CHAINS = 1
"""Lookup chains proposed per round (distinct continuations of the matched suffix, most recent first)."""


class LookupSource:
    def __init__(self, prompt=(), *, chains: int = CHAINS, index: LookupIndex | None = None):
        self.index = index_over(prompt, index)  # `index`: restored over the prompt's first positions, or None
        self.chains = chains
        self.verified: dict[int, int] = {}
        self.accepted: dict[int, int] = {}
        self.trie, self.first = Trie(), []
        self.rooted = False  # whether this round's root joined the stream when proposing
        self.copying = False  # whether the last verified round accepted its whole first chain

    def log_accept(self, depth: int) -> float:
        return math.log((self.accepted.get(depth, 0) + 1) / (self.verified.get(depth, 0) + 2))

    def propose(self, *, root: int, max_len: int) -> float:
        """This round's chains, at most `max_len` tokens after `root`, as a trie; returns the expected accepted
        tokens of the first chain (each depth at its running acceptance, a token accepted only after its parent)."""
        self.index.extend([root])
        self.rooted = True
        chains = self.index.propose(max_len=max_len, n_alternatives=self.chains)
        self.trie, self.first = Trie.of(chains), chains[0] if chains else []
        expected, p = 0.0, 1.0
        for d in range(len(self.first)):
            p *= math.exp(self.log_accept(d))
            expected += p
        return expected

    def length(self, base: int, longest: int) -> int:
        """How long this round's chains may be: `longest` right after a round that accepted its whole chain, else
        `base`. An answer that copies its input copies in runs: on the bench's sets, a round after a fully accepted
        4-token chain accepted all of its own 69-75% of the time, so a chain that has just been right is worth
        verifying further."""
        return longest if self.copying else base

    def chain(self, root: int) -> Tree:
        """The round's first chain alone (proposed by `propose`), as the whole tree."""
        return Tree.chain(self.first, root=root)

    def scorer(self, inner) -> LookupScorer:
        """`inner` with this round's chains (proposed by `propose`) added."""
        return LookupScorer(inner, self.trie, [self.log_accept(d) for d in range(inner.depth)])

    def observe(self, tree: Tree, accepted: list[int]) -> int:
        """Count the verified tree's lookup nodes whose parent was accepted, and which of them were; commit the
        accepted tokens to the index. Returns the accepted nodes that were lookup nodes."""
        at = self.trie.nodes(tree) if self.rooted else [-1] * len(tree)
        on_path = set(accepted)
        taken = 0
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            if at[i] < 0 or p not in on_path:
                continue
            d = int(tree.depths[i]) - 1
            self.verified[d] = self.verified.get(d, 0) + 1
            if i in on_path:
                self.accepted[d] = self.accepted.get(d, 0) + 1
                taken += 1
        committed = tree.tokens[accepted[1:]].tolist()
        self.copying = bool(self.first) and committed[: len(self.first)] == self.first
        # the root joined the stream when proposing
        self.index.extend(committed if self.rooted else [int(tree.tokens[0]), *committed])
        self.rooted, self.trie, self.first = False, Trie(), []
        return taken


Kind = Literal["chain", "draft", "bare", "root"]
"""A round's kind: the chain alone, drafted with a chain, drafted without one, the root alone (an AR step)."""


class ChainOrDraft:
    """What a round verifies, by tokens per second (running means, decay 0.9, over the rounds of each kind):
    - with a chain of `length` tokens expected to give `expected` accepted tokens, the chain goes alone where
      1 + expected tokens in a chain-alone round's seconds (those of chains of its length, where one was timed: a
      verify's cost grows with its width) reach the 1 + `gain` tokens drafted rounds have been giving in theirs
      (until both kinds have been timed they count as equally long); and the root goes alone instead where
      root-alone rounds (AR steps) give at least as many tokens a second as the kind so chosen: a chain that is
      rarely right (a sampled answer's) costs a wider verify for little. After EXPLORE such rounds in a row, the
      chain or the drafter's tree is verified anyway, so that the chain's running acceptance stays current;
    - with no chain, the root goes alone where drafted rounds without a chain have been giving no more tokens a
      second than root-alone rounds give: a drafter whose trees are rarely followed (a small target's samples at
      T>0) then costs nothing. The root goes alone once to be timed, and a round drafts again after EXPLORE
      root-alone rounds, so that the drafted rounds' figures stay current: twice as many after each such round that
      did not turn the choice (up to EXPLORE_MAX), EXPLORE again once drafting is chosen.
    Each round's seconds run from its `choose` to the next one's, so commit and the loop count for every kind;
    `restart` drops the round under way (the time between generations is no round's)."""

    DECAY = 0.9
    EXPLORE = 16  # root-alone rounds after which a round drafts (no chain) or verifies its chain anyway
    EXPLORE_MAX = 256  # the most root-alone rounds between two drafted rounds without a chain
    root_alone = True  # whether a round may verify the root alone (the tests' pairs: off, see conftest)

    def __init__(self, gain: float = 1.0):
        self.gain = gain  # prior: a drafted round accepts one draft token (a tau of 2)
        self.bare_gain = gain  # the same over drafted rounds that had no chain
        self.seconds: dict[Kind, float] = {}  # seconds a round of each kind ("draft": drafted, with a chain or not)
        self.chain_seconds: dict[int, float] = {}  # seconds a chain-alone round, by the chain's length
        self.idle = 0  # root-alone rounds since the last drafted round
        self.explore = self.EXPLORE  # root-alone rounds after which a round with no chain drafts anyway
        self.probed = False  # whether the last round with no chain drafted only because of that
        self.passed = 0  # root-alone rounds that passed a chain over, since the last that verified one
        self._round: tuple[Kind, float, int] | None = None

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else self.DECAY * old + (1 - self.DECAY) * new

    def restart(self):
        self._round = None

    def choose(self, expected: float, now: float, length: int = 0) -> Kind:
        """This round's kind (its chain of `length` tokens expected to give `expected` tokens; 0: no chain); `now`:
        the clock at the round's start."""
        if self._round is not None:
            kind, t0, n = self._round
            for k in ("draft", kind) if kind == "bare" else (kind,):
                self.seconds[k] = self._mean(self.seconds.get(k), now - t0)
            if kind == "chain":
                self.chain_seconds[n] = self._mean(self.chain_seconds.get(n), now - t0)
        s = self.seconds
        if expected > 0:
            timed = "chain" in s and "draft" in s
            chain_s, draft_s = (self.chain_seconds.get(length, s["chain"]), s["draft"]) if timed else (1.0, 1.0)
            kind = "chain" if (1 + expected) * draft_s >= (1 + self.gain) * chain_s else "draft"
            if timed and self.root_alone and "root" in s and self.passed < self.EXPLORE:
                rate = (1 + expected) / chain_s if kind == "chain" else (1 + self.gain) / draft_s
                kind = "root" if rate * s["root"] <= 1 else kind
            self.passed = self.passed + 1 if kind == "root" else 0
        elif not self.root_alone or "bare" not in s:
            kind = "bare"
        elif "root" not in s:
            kind = "root"
        elif self.idle >= self.explore:
            kind, self.probed = "bare", True
        else:
            kind = "root" if s["bare"] >= (1 + self.bare_gain) * s["root"] else "bare"
            if kind == "bare":
                self.explore = self.EXPLORE
            elif self.probed:
                self.explore = min(2 * self.explore, self.EXPLORE_MAX)
            self.probed = False
        self.idle = 0 if kind in ("draft", "bare") else self.idle + (kind == "root")
        self._round = (kind, now, length)
        return kind

    def observe_drafted(self, accepted_drafts: int):
        """A drafted round's accepted draft tokens."""
        self.gain = self._mean(self.gain, accepted_drafts)
        if self._round is not None and self._round[0] == "bare":
            self.bare_gain = self._mean(self.bare_gain, accepted_drafts)

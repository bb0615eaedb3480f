"""cadominotree's adaptive budget: each round's tree size maximises expected tokens per second on the running
backend's measured costs, with an acceptance map calibrated online from the rounds' accepted paths.

    E[tokens](n) = 1 + sum_{i <= n} a(logw_i)       a: calibrated P(node accepted | its cumulative log score)
    cost(n)      = C_d + c * n + s * C_v(n; l) + o   C_d the drafter's block and its context catch-up, c the
                                                     builder's cost per node (the scorer's children and GRU
                                                     steps), C_v the verify-cost curve, s and o learnt from the
                                                     rounds (RoundClock)
    theta(n)     = E[tokens](n) / cost(n)            nodes are admitted best-first while theta rises

A round drafts at all only while the trees lately built promise more than a root-alone round, 1 / (s * C_v(0; l) +
o); otherwise the round is the root alone (one AR step, no drafter call), and a probe round drafts now and then
to keep the estimates current, less often while probes keep finding nothing that pays. Any tree gives exactly the
target's tokens, so none of this can change the output, only its speed.
"""

import math
from dataclasses import astuple, dataclass, field

from dtrt.tree.caddtree import CostCurve, _isotonic

# upper edges of the bins of a node's cumulative log score, best first: (-inf, -4.5], ..., (-0.1, 0]
LOGW_EDGES = (-0.1, -0.25, -0.5, -1.0, -2.0, -3.0, -4.5)


def _bin(logw: float) -> int:
    for i, edge in enumerate(LOGW_EDGES):
        if logw > edge:
            return i
    return len(LOGW_EDGES)


def _center(b: int) -> float:
    hi = 0.0 if b == 0 else LOGW_EDGES[b - 1]
    lo = LOGW_EDGES[b] if b < len(LOGW_EDGES) else LOGW_EDGES[-1] - 2.0
    return math.exp((hi + lo) / 2)


@dataclass
class AcceptanceMap:
    """P(a node is accepted | its cumulative log score), per score bin: the bin's accepted / offered counts with
    `prior` pseudo-counts at the raw score exp(logw) times the overall ratio of accepted to predicted nodes (so a
    bin not seen yet inherits how over- or under-confident the scores are), made non-increasing over the bins (a
    better score never maps to a lower acceptance). Starts as the raw score itself."""

    prior: float = 4.0
    offered: list[float] = field(default_factory=lambda: [0.0] * (len(LOGW_EDGES) + 1))
    accepted: list[float] = field(default_factory=lambda: [0.0] * (len(LOGW_EDGES) + 1))
    _rates: list[float] | None = None

    def observe(self, scores: list[float], accepted: set[int]):
        """One verified tree: node i (1-based; 0 is the root) with cumulative log score scores[i] was accepted when
        i is in `accepted`."""
        for i in range(1, len(scores)):
            b = _bin(scores[i])
            self.offered[b] += 1
            self.accepted[b] += i in accepted
        self._rates = None

    def rates(self) -> list[float]:
        if self._rates is None:
            bins = range(len(self.offered))
            ratio = (sum(self.accepted) + 1) / (sum(o * _center(b) for b, o in zip(bins, self.offered)) + 1)
            raw = [
                (a + self.prior * min(1.0, ratio * _center(b))) / (o + self.prior)
                for b, a, o in zip(bins, self.accepted, self.offered)
            ]
            weights = [o + self.prior for o in self.offered]
            # non-increasing over the bins = non-decreasing over them reversed
            self._rates = _isotonic(raw[::-1], weights[::-1])[::-1]
        return self._rates

    def __call__(self, logw: float) -> float:
        return self.rates()[_bin(logw)]


@dataclass
class NodeCost:
    """The builder's seconds per admitted node, a running least-squares slope of build time over node count
    (the mean time per node until the counts vary)."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, nodes: int, seconds: float):
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + nodes, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + nodes * nodes, d * self.sxy + nodes * seconds

    @property
    def per_node(self) -> float:
        if self.n == 0 or self.sx == 0:
            return 0.0
        var = self.sxx - self.sx * self.sx / self.n
        if var <= 1e-9 * self.n:
            return self.sy / self.sx
        return max(0.0, (self.sxy - self.sx * self.sy / self.n) / var)


# the verify seconds in the loop over the curve's, as RoundClock corrects the curve: what the loop adds to a call
# timed alone (about 1.2x), not a replacement for the curve, which stays the measure of how the cost grows with n
SCALE_RANGE = (0.5, 2.0)


@dataclass
class RoundClock:
    """What the rounds as they run teach the cost model, beyond the curve measured apart: `overhead` (o), the
    seconds of a round outside drafting, building and verifying (commit, the loop), which every round pays whatever
    it verifies (the drafter's context is caught up by the next round that drafts, in its drafting); `scale` (s),
    the verify seconds in the loop over the curve's (a call there, between other work and over a past that grows,
    costs more than one timed alone at a fixed past). Without them a round's fixed costs are missed and the root
    alone looks cheaper than it is. Running means."""

    decay: float = 0.9
    overhead: float = 0.0
    scale: float = 1.0
    _seen: tuple[bool, bool] = (False, False)

    def observe_rest(self, seconds: float):
        first = not self._seen[0]
        self.overhead = seconds if first else self.decay * self.overhead + (1 - self.decay) * seconds
        self._seen = (True, self._seen[1])

    def observe_verify(self, seconds: float, predicted: float):
        if predicted <= 0:
            return
        ratio = min(max(seconds / predicted, SCALE_RANGE[0]), SCALE_RANGE[1])
        self.scale = ratio if not self._seen[1] else self.decay * self.scale + (1 - self.decay) * ratio
        self._seen = (self._seen[0], True)

    def round_cost(self, verify_s: float) -> float:
        """A round's seconds apart from drafting and building, for a verify the curve puts at `verify_s`."""
        return self.overhead + self.scale * verify_s


@dataclass
class AdaptiveStop:
    """The `stop` of the heap builder: admit a node only while theta rises (see the module's formulas)."""

    curve: CostCurve
    context_len: int
    acceptance: AcceptanceMap
    draft_s: float
    node_s: float
    clock: RoundClock = field(default_factory=RoundClock)
    gain: float = 1.0
    theta: float = 0.0
    nodes: int = 0  # admitted so far

    def cost(self, n: int) -> float:
        return self.draft_s + self.node_s * n + self.clock.round_cost(self.curve.verify_cost(n, self.context_len))

    def start(self):
        self.gain, self.nodes = 1.0, 0
        self.theta = 1.0 / self.cost(0)

    def admit(self, n_nodes: int, logw: float) -> bool:
        gain = self.gain + self.acceptance(logw)
        theta = gain / self.cost(n_nodes + 1)
        if theta <= self.theta:
            return False
        self.gain, self.theta, self.nodes = gain, theta, n_nodes + 1
        return True

    def tree(self) -> "TreeEstimate":
        """The tree admitted, as the gate keeps it."""
        n = self.nodes
        return TreeEstimate(self.gain, self.draft_s + self.node_s * n, self.curve.verify_cost(n, self.context_len))


@dataclass(frozen=True)
class TreeEstimate:
    """A built tree as the model saw it: expected tokens, seconds of drafting and building, the curve's verify
    seconds (before RoundClock's correction, so that a later clock can price it again)."""

    gain: float
    own_s: float
    verify_s: float

    def theta(self, clock: RoundClock) -> float:
        return self.gain / (self.own_s + clock.round_cost(self.verify_s))


@dataclass
class SpeculationGate:
    """Whether the next round drafts: while the recent trees, priced by the current clock, beat a root-alone
    round's rate; otherwise a probe round drafts once every `interval` rounds to keep the estimates current. The
    interval starts at `probe` and doubles, up to `max_probe`, after each probe whose tree does not beat the root
    alone either (a probe pays for the drafter's catch-up over every round since the last draft, so on a target
    where nothing pays, a fixed interval is a fixed loss); it falls back to `probe` when one does."""

    probe: int = 16
    max_probe: int = 256
    decay: float = 0.8
    trees: TreeEstimate | None = None  # running mean of the trees built
    since_draft: int = 0
    interval: int = 0  # rounds between probes now (`probe` to begin with)
    _probing: tuple[RoundClock, float] | None = None  # a probe round's clock and root-alone rate, until its tree

    def __post_init__(self):
        self.interval = self.interval or self.probe

    def observe_tree(self, tree: TreeEstimate):
        if self._probing is not None:
            clock, root = self._probing
            pays = tree.theta(clock) > root
            self.interval = self.probe if pays else min(2 * self.interval, self.max_probe)
            self._probing = None
        if self.trees is not None:
            old, d = self.trees, self.decay
            tree = TreeEstimate(*(d * a + (1 - d) * b for a, b in zip(astuple(old), astuple(tree))))
        self.trees = tree
        self.since_draft = 0

    def drafts(self, clock: RoundClock, root_verify_s: float) -> bool:
        """`root_verify_s`: the curve's verify seconds of the root alone at this round's context."""
        root = 1.0 / clock.round_cost(root_verify_s)
        if self.trees is None or self.trees.theta(clock) > root:
            return True
        if self.since_draft + 1 >= self.interval:
            self._probing = (clock, root)
            return True
        self.since_draft += 1
        return False

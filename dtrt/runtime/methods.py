"""Speculative methods as small strategy objects: each turns one round's drafter output into a Tree, and declares
its traits as class attributes: the registry (METHODS, method_class) is what the spec, the launch layer, the export
backends and the bench ask, so adding a method is one class here and its tests.

ar          no draft; the tree is the root alone
lookup      chain copied from the request's own tokens (prompt lookup, dtrt.tree.lookup); no drafter
dflash      chain of the drafter's marginal argmax (one child per node)
domino      chain of Domino's corrected argmax over the full vocabulary
ddtree      best-first over the marginals (lazy sibling/child heap), fixed budget
caddtree    ddtree with the cost-aware stopping rule on this backend's verify-cost curve (measured once per machine)
dominotree  best-first over corrected scores, per realized path (`--arm` condstatic / marg for ablations); with
            --lookup, the heap builder also takes the lookup chains' nodes (dtrt.tree.lookup_source)
cadominotree  dominotree with the adaptive budget (dtrt.tree.adaptive: calibrated acceptance, every per-node cost,
            the root alone when drafting does not pay; heap builder; --budget is the cap)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

import torch

from dtrt.errors import DtrtError
from dtrt.runtime.calibrate import cost_curve
from dtrt.tree import CostAwareStop, Round, Tree, best_marginal_child, build_ddtree, build_heap
from dtrt.tree.adaptive import AcceptanceMap, AdaptiveStop, NodeCost, RoundClock, SpeculationGate
from dtrt.tree.grammar import GrammarScorer
from dtrt.tree.lookup import LookupIndex
from dtrt.tree.lookup_source import ChainOrDraft, LookupSource

if TYPE_CHECKING:
    from dtrt.runtime.spec import RunSpec


class Method:
    name: ClassVar[str]
    """`--method`'s value."""
    uses_drafter: ClassVar[bool] = True
    """Whether it drafts with the drafter (else no drafter is loaded)."""
    has_budget: ClassVar[bool] = False
    """Whether --budget sizes its trees (lookup: its chain's length); the bench sweeps it, labels show it."""
    cost_aware: ClassVar[bool] = False
    """Whether each round chooses its own tree size: --budget is the cap (default: an export's width)."""
    builders: ClassVar[tuple[str, ...]] = ()
    """The --builder values it grows its trees with (empty: --builder does not apply)."""
    takes_lookup: ClassVar[bool] = False
    """Whether --lookup adds prompt lookup's chains to its trees (the heap builder takes them)."""
    cuda_graph: ClassVar[bool] = False
    """Whether --cuda-graph can capture its drafting and building (the fixed-shape frontier)."""

    graph = None
    """This method's drafting graph under --cuda-graph (dtrt.runtime.draft_graph.DraftGraph), else None: a fused
    round queues the next round's drafting on it before the host reads the round back."""

    @classmethod
    def needs_head(cls, spec: RunSpec) -> bool:
        """Whether it scores with Domino's correction head under `spec` (a Domino drafter is then needed)."""
        return False

    @classmethod
    def drafter_stages(cls, spec: RunSpec) -> tuple[str, ...]:
        """The exported drafter stages it runs under `spec` besides the drafter's context and block: `scorer`
        (Domino's per-path scorer), `chain` (Domino's full-vocabulary chain), `frontier` (the frontier builder)."""
        return ("scorer",) if cls.needs_head(spec) else ()

    grammar = None
    """This generation's dtrt.runtime.grammar.GrammarState (structured output; None: free text): the loop sets it
    before `begin`, and the tree builders take only the tokens it allows at each path."""

    def __init__(self, cfg: RunSpec):
        self.cfg = cfg

    def masked(self, scorer):
        """`scorer` with the grammar's masks (dtrt.tree.grammar.GrammarScorer), or `scorer` itself without one."""
        return scorer if self.grammar is None else GrammarScorer(scorer, self.grammar)

    def calibrate(self, backend):
        """Called once per generation before the backend's caches are reset for it: a method that measures the
        backend does it here."""

    def begin(self, prompt: list[int], index: LookupIndex | None = None, *, sampled: bool = False):
        """Called once per generation with its prompt, after prefill, for every method. `index`: the prompt-lookup
        index over the prompt's first positions, restored from the prefix cache, for a method with lookup to extend
        over the rest (it is this generation's own); `sampled`: whether the generation samples (T>0)."""

    @property
    def uses_lookup(self) -> bool:
        """Whether the method keeps a prompt-lookup index (`lookup_index`)."""
        return False

    def lookup_index(self) -> LookupIndex | None:
        """This generation's prompt-lookup index (over the prompt and the tokens committed so far), or None for a
        method without lookup: the prefix cache keeps it beside the prompt's snapshot."""
        return None

    def prepare(self, backend, max_depth: int):
        """Called once per generation, after prefill, for a method with a drafter."""
        self.max_depth = max_depth

    def build(self, backend, rnd: Round) -> Tree:
        raise NotImplementedError

    def drafts(self, start: int, root: int) -> bool:
        """Whether the round rooted at `root` (position `start`) drafts (else it verifies `undrafted`'s tree); asked
        once per round, before the loop brings the drafter's context up to date for `draft`."""
        return True

    def undrafted(self, root: int) -> Tree:
        """The tree of a round that does not draft: the root alone."""
        return Tree.chain([], root=root)

    def rows(self, backend) -> int:
        """The drafter rows (depths) this round's tree can reach, known before drafting: the block computes the base
        logits of these only. Fewer rows than the builder would read change no tree."""
        return backend.drafter.cfg.k_draft

    def draft(self, backend, root: int, start: int) -> tuple[Tree, float]:
        """This round's tree from the drafter block rooted at `root` (position `start`), and the clock when the
        drafting part ended (the rest built the tree)."""
        ph, logits = backend.draft_block(root, start, rows=self.rows(backend))
        drafted = time.perf_counter()
        rnd = Round(ph[None], logits[None], torch.tensor([root], device=ph.device), *backend.draft_columns())
        return self.build(backend, rnd), drafted

    def stop(self, backend):
        """A best-first builder's stopping rule for this round (None: the fixed budget)."""
        return None

    def observe(self, tree: Tree, accepted: list[int]) -> int | None:
        """Called after each verify with the verified tree and its accepted node indices (root included); returns
        how many accepted draft nodes came from prompt lookup where the tree holds lookup nodes (--method lookup:
        all of them; --lookup), else None."""


class AR(Method):
    name = "ar"
    uses_drafter = False

    def drafts(self, start, root):
        return False


class Lookup(Method):
    """Prompt lookup: the chain is the continuation of the longest earlier match of the request's suffix (its
    prompt and committed tokens), --budget tokens long; the root alone where nothing matches."""

    name = "lookup"
    uses_drafter = False
    has_budget = True

    def begin(self, prompt, index=None, *, sampled=False):
        self.source = LookupSource(prompt, index=index)  # the source --lookup gives the tree methods; fixed length

    uses_lookup = True

    def lookup_index(self):
        return self.source.index

    def draft(self, backend, root, start):
        self.source.propose(root=root, max_len=self.cfg.budget)
        return self.source.chain(root), time.perf_counter()

    def observe(self, tree, accepted):
        return self.source.observe(tree, accepted)  # every accepted draft node is lookup's


class DFlashChain(Method):
    """One child per node down to the drafter's depth: the marginals' argmax, DFlash's own draft."""

    name = "dflash"

    def rows(self, backend):
        return min(self.max_depth, backend.drafter.cfg.k_draft)

    def build(self, backend, rnd):
        scorer = self.masked(backend.scorer("marg", rnd, 1, self.cfg.topm))
        return build_heap(scorer, self.max_depth, self.max_depth)


class DominoChain(Method):
    """Domino's own draft: the corrected argmax over the full vocabulary at every depth (--topm does not apply)."""

    name = "domino"

    @classmethod
    def needs_head(cls, spec):
        return True

    @classmethod
    def drafter_stages(cls, spec):
        return ("chain",)

    def rows(self, backend):
        return min(self.max_depth, backend.drafter.cfg.k_draft)

    def build(self, backend, rnd):
        tokens = backend.domino_chain(rnd)[: self.max_depth]
        return Tree.chain(tokens.tolist(), root=int(rnd.root[0]))


class DDTree(Method):
    name = "ddtree"
    has_budget = True

    def rows(self, backend):
        # a tree of `budget` nodes is at most `budget` deep (build_ddtree reads every row it is given)
        return min(self.cfg.budget, backend.drafter.cfg.k_draft)

    def build(self, backend, rnd):
        logprobs = torch.log_softmax(rnd.logits[0], dim=-1)
        root = int(rnd.root[0])
        return build_ddtree(logprobs, self.cfg.budget, self.stop(backend), root=root, ids=rnd.ids, masks=self.grammar)


class CostAware:
    """CaDDTree's stopping rule for a best-first builder: admit a node only while it raises the expected tokens
    per second on the backend's verify-cost curve (dtrt.runtime.calibrate: stored per machine, or measured before
    the first generation)."""

    cost_aware = True
    curve = None

    def calibrate(self, backend):
        if self.curve is None:
            self.curve = cost_curve(backend, self.cfg.budget)

    def stop(self, backend):
        return CostAwareStop(self.curve, backend.past)


class CaDDTree(CostAware, DDTree):
    name = "caddtree"


class DominoTree(Method):
    """With --lookup, a round first proposes lookup's chain: where its expected accepted tokens (at the request's
    running acceptance per depth) per second of a chain-alone round reach what drafted rounds have been accepting
    per second (ChainOrDraft: running means over this method's rounds of each kind), the chain alone is verified
    and nothing is drafted; otherwise the drafter's tree takes the chain's nodes too (one budget). The root goes
    alone instead where root-alone rounds give at least the tokens a second of the kind so chosen, and where there
    is no chain while drafted rounds give no more than they do. Greedy and sampled generations keep their own
    figures (a drafter's trees are followed far less often at T>0)."""

    name = "dominotree"
    has_budget = True
    builders = ("heap", "frontier")
    takes_lookup = True
    cuda_graph = True
    lookup = None
    _chain_only = _measured = False  # this round: the chain alone; a drafted round whose gain counts

    def __init__(self, cfg):
        super().__init__(cfg)
        # what each kind of round gives, carried between generations: greedy ones, sampled ones
        self.policies = {False: ChainOrDraft(), True: ChainOrDraft()}
        self.policy = self.policies[False]

    @classmethod
    def needs_head(cls, spec):
        return spec.arm != "marg"

    @classmethod
    def drafter_stages(cls, spec):
        frontier = spec.builder == "frontier" and spec.arm == "dominotree"  # the stage scores the dominotree arm
        return super().drafter_stages(spec) + (("frontier",) if frontier else ())

    def begin(self, prompt, index=None, *, sampled=False):
        if self.cfg.lookup:
            self.lookup = LookupSource(prompt, index=index)
            self.policy = self.policies[sampled]
            self.policy.restart()  # a round left under way by its last generation is no round

    @property
    def uses_lookup(self):
        return self.cfg.lookup

    def lookup_index(self):
        return self.lookup.index if self.cfg.lookup else None

    def rows(self, backend):
        if self.cfg.builder == "frontier":  # the exported frontier stage's shapes are fixed: every row
            return backend.drafter.cfg.k_draft
        return min(self.cfg.budget, self.max_depth, backend.drafter.cfg.k_draft)

    def prepare(self, backend, max_depth):
        super().prepare(backend, max_depth)
        if self.cfg.cuda_graph and (self.graph is None or self.graph.backend is not backend):
            from dtrt.runtime.draft_graph import DraftGraph

            self.graph = DraftGraph(backend, self)
        if self.graph is not None:
            self.graph.cancel()  # a drafting queued by the last generation's last round

    def propose(self, root: int) -> float:
        """Lookup's chains for this round (see LookupSource.propose): their expected accepted tokens. They are
        --budget tokens long, or as deep as a tree may go right after a round that accepted its whole chain
        (LookupSource.length): a drafted round's heap still takes --budget nodes of them at most."""
        base = min(self.cfg.budget, self.max_depth)
        return self.lookup.propose(root=root, max_len=self.lookup.length(base, self.max_depth))

    def drafts(self, start, root):
        if self.lookup is None:
            return True
        expected = self.propose(root)
        kind = self.policy.choose(expected, time.perf_counter(), len(self.lookup.first))
        self._chain_only = kind == "chain"
        self._measured = kind in ("draft", "bare")
        return self._measured

    def undrafted(self, root):
        return self.lookup.chain(root) if self._chain_only else super().undrafted(root)  # the chain, or the root, alone

    def build(self, backend, rnd):
        c = self.cfg
        if c.builder == "frontier":
            return self.trees(backend, rnd).tree(0)
        scorer = backend.scorer(c.arm, rnd, c.node_topk, c.topm)
        if self.lookup is not None:
            scorer = self.lookup.scorer(scorer)
        return build_heap(self.masked(scorer), c.budget, self.max_depth, self.stop(backend))

    def trees(self, backend, rnd):
        """The frontier's FrontierTrees, still on the round's device (on an export backend: one stage call)."""
        c = self.cfg
        return backend.frontier(rnd, c.budget, c.arm, c.node_topk, c.topm, self.max_depth)

    def one_marginal_child(self, backend) -> bool:
        """Whether this round's tree is build_heap's budget-1 tree over the base marginal at depth 0: one node, the
        heap builder, and a depth 0 that reads no Domino state (the marg arm, or a drafter whose prefix_len covers
        it). Such a round is built from the block's first row (and lookup's next tokens) alone (best_marginal_child)."""
        c = self.cfg
        marginal = c.arm == "marg" or backend.drafter.cfg.pure_draft_prefix_len >= 1
        plain = self.grammar is None  # a grammar's masks need the scorer's paths
        return c.budget == 1 and c.builder == "heap" and self.max_depth >= 1 and marginal and plain

    def draft(self, backend, root, start):
        if self.graph is not None:
            tree = self.graph(root, start)  # one replay: the draft time includes the build
            return tree, time.perf_counter()
        if not self.one_marginal_child(backend):
            return super().draft(backend, root, start)
        # a Round, a scorer and the heap cost a tenth of a target step here, for one top-k over one row
        _, logits = backend.draft_block(root, start, rows=1)
        drafted = time.perf_counter()
        ids, vocab = backend.draft_columns()
        columns = logits.shape[-1]
        k = self.cfg.node_topk  # the scorers' top-k width at depth 0 (dtrt.scoring, dtrt.scoring.stages)
        if self.cfg.arm != "marg":
            full = vocab if ids is not None else columns
            k = min(k, min(self.cfg.topm, full) or full)
        chain, log_accept = (), 0.0
        if self.lookup is not None:  # the next tokens of this round's chains, at depth 0's running acceptance
            chain, log_accept = tuple(self.lookup.trie.children[0]), self.lookup.log_accept(0)
        return best_marginal_child(logits[0], root, k, ids, self.stop(backend), chain, log_accept), drafted

    def observe(self, tree, accepted):
        if self.lookup is None:
            return None
        if self._measured:
            self.policy.observe_drafted(len(accepted) - 1)
            self._measured = False
        return self.lookup.observe(tree, accepted)


class CaDominoTree(CostAware, DominoTree):
    """DominoTree whose tree size maximises expected tokens per second (dtrt.tree.adaptive): CostAware's measured
    curve with its own stop. What it learns (the acceptance map, the costs of drafting, of each node and of the
    rest of a round) carries over between generations of this method object."""

    name = "cadominotree"
    builders = ("heap",)  # it decides per node whether to grow the tree, which the host heap does
    cuda_graph = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.acceptance, self.node_cost, self.gate = AcceptanceMap(), NodeCost(), SpeculationGate()
        self.clock = RoundClock()
        self.draft_s = None
        self._stop = self._built = self._round = None
        self._drafted = self._verified = None  # this round's clock when its tree was ready, and when it was verified

    def prepare(self, backend, max_depth):
        super().prepare(backend, max_depth)
        if self.draft_s is None:
            self.draft_s = self.curve.draft_cost
        self._drafted = self._verified = None  # the time between generations is no round's

    def stop(self, backend):
        self._stop = AdaptiveStop(
            self.curve, backend.past, self.acceptance, self.draft_s, self.node_cost.per_node, self.clock
        )
        return self._stop

    def drafts(self, start, root):
        """The gate decides whether to draft; with --lookup, a round that does not draft verifies lookup's chain
        (the root alone where nothing matches), and one that drafts takes the chain into its tree."""
        self._round = t0 = time.perf_counter()
        if self._verified is not None:  # the last round's commit and loop
            self.clock.observe_rest(t0 - self._verified)
        self._start = start
        if self.lookup is not None:
            self.propose(root)
        if self.gate.drafts(self.clock, self.curve.verify_cost(0, start)):
            self._chain_only = False
            return True
        self._chain_only = self.lookup is not None
        self._drafted = time.perf_counter()
        return False

    def draft(self, backend, root, start):
        # the drafting seconds count from the round's start: they include bringing the drafter's context up to
        # date, which a round that drafts pays for the rounds that did not
        tree, drafted = super().draft(backend, root, start)
        self._drafted = time.perf_counter()
        self._built = (drafted - self._round, self._drafted - drafted, tree.num_nodes)
        self.gate.observe_tree(self._stop.tree())
        return tree, drafted

    def observe(self, tree, accepted):
        from_lookup = super().observe(tree, accepted)
        self._verified = time.perf_counter()
        if self._drafted is not None:
            predicted = self.curve.verify_cost(tree.num_nodes, self._start)
            self.clock.observe_verify(self._verified - self._drafted, predicted)
        if self._built is None:  # a root-alone round: nothing drafted
            return from_lookup
        draft_s, build_s, nodes = self._built
        self._built = None
        self.acceptance.observe(tree.scores.tolist(), set(accepted))
        self.node_cost.observe(nodes, build_s)
        self.draft_s = 0.9 * self.draft_s + 0.1 * draft_s
        return from_lookup


METHODS: dict[str, type[Method]] = {
    m.name: m for m in (AR, Lookup, DFlashChain, DominoChain, DDTree, CaDDTree, DominoTree, CaDominoTree)
}


def method_class(name: str) -> type[Method]:
    """The registry's class for `--method name`; a one-line error naming the choices for anything else."""
    if name not in METHODS:
        raise DtrtError(f"--method {name!r}: use one of {', '.join(METHODS)}")
    return METHODS[name]


def make_method(cfg: RunSpec) -> Method:
    return method_class(cfg.method)(cfg)

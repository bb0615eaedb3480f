"""Speculative methods as small strategy objects: each turns one round's drafter output into a Tree.

ar          no draft; the tree is the root alone
dflash      chain of the drafter's marginal argmax (one child per node)
domino      chain of Domino's corrected argmax
ddtree      best-first over the marginals (lazy sibling/child heap), fixed budget
caddtree    ddtree with the cost-aware stopping rule on this backend's measured verify-cost curve
dominotree  best-first over corrected scores, per realized path (`--arm` condstatic / marg for ablations)
cadominotree  dominotree with caddtree's cost-aware stopping rule (heap builder; --budget is the cap)
"""

import time
from dataclasses import dataclass

import torch

from dtrt.errors import DtrtError
from dtrt.runtime.calibrate import measure_cost_curve
from dtrt.tree import Round, Tree, build_ddtree, build_frontier, build_heap
from dtrt.tree.caddtree import CostAwareStop

METHODS = ("ar", "dflash", "domino", "ddtree", "caddtree", "dominotree", "cadominotree")
TREE_METHODS = ("dominotree", "cadominotree")  # Domino's per-path scorer: --builder, --arm, --node-topk
BUILDERS = ("heap", "frontier")
ARMS = ("dominotree", "condstatic", "marg")


@dataclass
class DraftConfig:
    method: str = "dominotree"
    budget: int = 16  # draft nodes per tree (verify width budget + 1); caddtree, cadominotree: the cap
    builder: str = "heap"  # dominotree only (cadominotree: heap)
    arm: str = "dominotree"
    topm: int = 64  # Domino candidates per depth (0 = full vocabulary)
    node_topk: int = 8  # children per node
    cuda_graph: bool = False  # dominotree with the frontier: drafting + tree building replayed as one CUDA graph

    def __post_init__(self):
        for flag, value, allowed in (
            ("--method", self.method, METHODS),
            ("--builder", self.builder, BUILDERS),
            ("--arm", self.arm, ARMS),
        ):
            if value not in allowed:
                raise DtrtError(f"{flag} {value!r}: use one of {', '.join(allowed)}")
        for flag, value, low in (
            ("--budget", self.budget, 1),
            ("--node-topk", self.node_topk, 1),
            ("--topm", self.topm, 0),
        ):
            if value < low:
                raise DtrtError(f"{flag} {value}: must be >= {low}")
        if self.method == "cadominotree" and self.builder != "heap":
            raise DtrtError(
                f"--builder {self.builder}: cadominotree decides per node whether to grow the tree, "
                f"which the host heap builder does; use --builder heap (or --method dominotree)"
            )
        if self.cuda_graph and (self.method != "dominotree" or self.builder != "frontier"):
            given = f"--method {self.method}" if self.method != "dominotree" else f"--builder {self.builder}"
            raise DtrtError(
                f"--cuda-graph: captures DominoTree's fixed-shape frontier build, not {given}; use "
                f"--method dominotree --builder frontier"
            )

    @property
    def needs_head(self) -> bool:
        return self.method == "domino" or (self.method in TREE_METHODS and self.arm != "marg")


class Method:
    uses_drafter = True

    def __init__(self, cfg: DraftConfig):
        self.cfg = cfg

    def prepare(self, backend, max_depth: int):
        """Called once per generation, after prefill."""
        self.max_depth = max_depth

    def build(self, backend, rnd: Round) -> Tree:
        raise NotImplementedError

    def draft(self, backend, root: int, start: int) -> tuple[Tree, float]:
        """This round's tree from the drafter block rooted at `root` (position `start`), and the clock when the
        drafting part ended (the rest built the tree)."""
        ph, base = backend.draft_block(root, start)
        drafted = time.perf_counter()
        return self.build(backend, Round(ph[None], base[None], torch.tensor([root], device=ph.device))), drafted

    def stop(self, backend):
        """A best-first builder's stopping rule for this round (None: the fixed budget)."""
        return None


class AR(Method):
    uses_drafter = False

    def build(self, backend, rnd):
        return Tree.chain([], root=int(rnd.root[0]))


class Chain(Method):
    """One child per node down to the drafter's depth: DFlash (marginals) or Domino (corrected)."""

    def __init__(self, cfg, arm):
        super().__init__(cfg)
        self.arm = arm

    def build(self, backend, rnd):
        return build_heap(backend.scorer(self.arm, rnd, 1, self.cfg.topm), self.max_depth, self.max_depth)


class DDTree(Method):
    def build(self, backend, rnd):
        logprobs = torch.log_softmax(rnd.base[0], dim=-1)
        return build_ddtree(logprobs, self.cfg.budget, self.stop(backend), root=int(rnd.root[0]))


class CostAware:
    """CaDDTree's stopping rule for a best-first builder: admit a node only while it raises the expected tokens
    per second on the verify-cost curve measured on the first generation's backend (then reused)."""

    curve = None

    def prepare(self, backend, max_depth):
        super().prepare(backend, max_depth)
        if self.curve is None:
            self.curve = measure_cost_curve(backend, self.cfg.budget)

    def stop(self, backend):
        return CostAwareStop(self.curve, backend.past)


class CaDDTree(CostAware, DDTree):
    pass


class DominoTree(Method):
    graph = None

    def prepare(self, backend, max_depth):
        super().prepare(backend, max_depth)
        if self.cfg.cuda_graph and (self.graph is None or self.graph.backend is not backend):
            from dtrt.runtime.draft_graph import DraftGraph

            self.graph = DraftGraph(backend, self)

    def build(self, backend, rnd):
        c = self.cfg
        if c.builder == "frontier":
            return self.trees(backend, rnd).tree(0)
        return build_heap(backend.scorer(c.arm, rnd, c.node_topk, c.topm), c.budget, self.max_depth, self.stop(backend))

    def trees(self, backend, rnd):
        """The frontier's FrontierTrees, still on the round's device."""
        c = self.cfg
        return build_frontier(
            backend.scorer(c.arm, rnd, c.node_topk, c.topm), c.budget, self.max_depth, backend.drafter.cfg.mask_token_id
        )

    def draft(self, backend, root, start):
        if self.graph is None:
            return super().draft(backend, root, start)
        tree = self.graph(root, start)  # one replay: the draft time includes the build
        return tree, time.perf_counter()


class CaDominoTree(CostAware, DominoTree):
    pass


def make_method(cfg: DraftConfig) -> Method:
    return {
        "ar": lambda: AR(cfg),
        "dflash": lambda: Chain(cfg, "marg"),
        "domino": lambda: Chain(cfg, "dominotree"),
        "ddtree": lambda: DDTree(cfg),
        "caddtree": lambda: CaDDTree(cfg),
        "dominotree": lambda: DominoTree(cfg),
        "cadominotree": lambda: CaDominoTree(cfg),
    }[cfg.method]()

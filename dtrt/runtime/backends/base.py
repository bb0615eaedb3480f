"""The backend contract: every call the decode loop (dtrt.runtime.generate), the methods (dtrt.runtime.methods),
the cost probes (dtrt.runtime.calibrate) and the CUDA-graph step (dtrt.runtime.draft_graph) make of a backend.

Shapes: N tree nodes or prompt tokens (root first), D = the drafter's k_draft, H hidden size, V vocabulary,
taps = the target layers the drafter reads. "Host" means CPU torch tensors; "device" means `backend.device`.
docs/DESIGN.md has this contract as a table.
"""

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from dtrt.errors import DtrtError
from dtrt.tree import FrontierTrees, Round, Tree

if TYPE_CHECKING:
    from dtrt.runtime.pipeline import Sources
    from dtrt.runtime.spec import RunSpec


class DrafterShape(Protocol):
    """What the loop and the methods read of `backend.drafter.cfg`."""

    block_size: int  # the drafter's block, slot 0 the committed token
    k_draft: int  # D: draft depths per block
    mask_token_id: int
    pure_draft_prefix_len: int  # depths below it use the base marginal, not Domino's correction
    target_layer_ids: tuple[int, ...] | list[int]


class BackendDrafter(Protocol):
    """What a backend's `drafter` is to the loop and the methods: its `cfg`."""

    cfg: DrafterShape


def check_rows(rows: int, k_draft: int) -> int:
    """`rows` for draft_block, checked: 1..k_draft."""
    if not isinstance(rows, int) or not 1 <= rows <= k_draft:
        raise DtrtError(f"draft_block: rows {rows!r} must be an int in 1..{k_draft} (the drafter's k_draft)")
    return rows


class Backend(ABC):
    name: str
    """`torch`, `onnxruntime` or `tensorrt`."""
    device: torch.device
    """Where logits, hidden states and drafter rows come back (and where sampling draws)."""
    drafter: BackendDrafter | None
    """The drafter this backend runs (its `cfg`), or None for a target alone (AR)."""
    max_context: int | None
    """Positions one generation may use (prompt + output + one tree), or None for no limit but memory."""
    context_source: str = ""
    """Where max_context comes from, for error messages."""

    @classmethod
    def open(cls, spec: "RunSpec", sources: "Sources") -> "Backend":
        """The backend `spec` describes over its opened sources, after the checks that only this backend makes (the
        flags against what the sources hold); dtrt.runtime.pipeline.open_pipeline dispatches here by --backend."""
        raise NotImplementedError(f"{cls.__name__} is not opened from a RunSpec")

    def context_fix(self, need: int) -> str | None:
        """The command that raises max_context to `need` positions, if there is one."""
        return None

    @abstractmethod
    def reset(self, capacity: int) -> None:
        """Empty caches for one generation of at most `capacity` positions."""

    @property
    @abstractmethod
    def past(self) -> int:
        """Committed positions in the target cache."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Positions the caches hold since the last reset."""

    @abstractmethod
    def target_forward(self, ids, positions, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions Long[N] and mask Bool[N, N] (causal for a prompt, the ancestor mask for a tree), on the
        host or the device -> (logits float32[N, V], hidden [N, taps*H]) on the device. The new entries wait after
        the past until commit."""

    @abstractmethod
    def commit(self, accepted) -> None:
        """Keep the accepted entries of the last target_forward (indices into its N, ascending, root first)."""

    def snapshot_refusal(self) -> str | None:
        """Why this backend's state cannot be snapshotted for the prefix cache (None: it can)."""
        return "this backend keeps no prefix snapshots"

    def snapshot(self, n: int) -> tuple:
        """Copies of the first `n` committed positions' state: the target's K/V, the drafter's context K/V."""
        raise NotImplementedError

    def restore(self, saved: tuple, n: int) -> None:
        """Right after reset: the first `n` positions of a snapshot as the committed past (drafter context too)."""
        raise NotImplementedError

    def verify(self, tree: Tree, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's target call over `tree` rooted at position `start`: its rows' logits and hidden states (the
        torch backend under --static-shapes: a call at the next fixed width, the tree padded with dead leaves)."""
        return self.target_forward(tree.tokens, tree.positions(start), tree.mask)

    def fuses(self, tree: Tree) -> bool:
        """Whether fused_round takes this tree (the torch backend under --static-shapes: up to its widest width)."""
        return False

    def fused_round(self, tree: Tree, *, context: bool = False, ahead=None, draws=None) -> tuple:
        """A round's verify, accept walk and commit on the device in one step, for a tree the backend `fuses`
        (`draws`, dtrt.runtime.sampling.Draws: T>0, every row's token drawn on the device; None: T=0):
        (logits, hidden of the tree's rows, the accepted indices, the bonus token, the tokens it commits: the
        accepted nodes' after the root, then the bonus), and with `context` the accepted rows' drafter context
        appended as draft_context would append it. `ahead`: the method's drafting graph, on which the round queues
        the next round's drafting from its own outputs before the host reads it back (DraftGraph.launch)."""
        raise NotImplementedError

    @abstractmethod
    def draft_context(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the drafter context of committed positions: hidden [n, taps*H] (as target_forward gave it),
        positions Long[n]."""

    @abstractmethod
    def draft_block(self, root: int, start: int, *, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter block rooted at token `root` at position `start`, its first `rows` proposal rows (1..D: the
        depths a round's tree can reach; the target's lm_head runs on these only): (ph [rows, H], base float32[rows,
        V']) on the device, the base logits over the columns draft_columns() names."""

    def draft_columns(self) -> tuple[torch.Tensor | None, int | None]:
        """The columns of draft_block's base logits: (the draft vocabulary's target ids Long[V'] on the device, the
        target's V), or (None, None) where they are the whole vocabulary (dtrt.tree.scorer.Round's `ids`)."""
        return None, None

    @abstractmethod
    def scorer(self, arm: str, rnd: Round, k: int, topm: int):
        """A scorer (dtrt.tree.scorer's protocol) over one round's drafter rows, for the host heap builders."""

    @abstractmethod
    def domino_chain(self, rnd: Round) -> torch.Tensor:
        """Domino's own draft of one round (batch 1): the corrected argmax over the full vocabulary at every depth,
        Long[D] on the device."""

    @abstractmethod
    def frontier(self, rnd: Round, budget: int, arm: str, k: int, topm: int, max_depth: int) -> FrontierTrees:
        """The whole DominoTree frontier build of one round (batch 1) as FrontierTrees on the device."""

    @abstractmethod
    def time_verify(self, n: int, past: int) -> None:
        """One verify of `n` nodes over `past` positions, for the cost probes; leaves the caches as they were."""

    def cost_key(self) -> dict | None:
        """What decides this backend's costs apart from the machine (JSON values), under which the cost-aware
        methods keep its measured verify-cost curve (dtrt.runtime.calibrate); None: measured in each process."""
        return None

    def max_depth(self, past: int) -> int | None:
        """The deepest tree this backend verifies exactly with `past` committed positions (None: any). A quantized
        export keeps trees inside the aligned attention block of their past (dtrt.ops.tree_attention)."""
        return None

    def time_draft(self, *, rows: int) -> None:
        """One drafter block of `rows` rows, for the cost probes."""
        self.draft_block(0, self.past, rows=rows)
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for the device's queued work (the cost probes time it from the host)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, spec) -> None:  # noqa: B027 (a backend with nothing to load keeps it empty)
        """Check, when the pipeline opens, that this backend can run `spec` (a RunSpec), loading what it needs:
        one-line errors naming the fix."""

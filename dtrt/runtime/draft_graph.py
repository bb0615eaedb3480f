"""One round's drafting and DominoTree frontier build as one CUDA graph (`--cuda-graph`, torch backend on CUDA).

Every shape in the step is fixed (the draft block attends over the draft cache's whole capacity by its committed
length, dtrt.models.layers.committed_attention; the frontier has fixed lanes and ledger) and no host value enters
it: root, start and the cache's committed length are device tensors written before each replay. The graph is
captured on the first round and again whenever the draft cache is reallocated. The tree comes out whole, padding
leaves included (FrontierTrees.whole), so nothing is read on the host between drafting and the verify. A fused
round (--static-shapes) queues the next round's drafting itself, from its own outputs on the device (`launch`),
before the host reads it back, so the GPU drafts while the host takes the read-back; the next call takes that
drafting. Off CUDA the same fixed-shape step runs eagerly, which is how the CPU tests check it.
"""

import torch

from dtrt.runtime.capture import capture
from dtrt.tree import FrontierTrees, Round, Tree


class DraftGraph:
    def __init__(self, backend, method):
        self.backend, self.method = backend, method
        dev = backend.device
        self.root, self.start, self.length = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(3))
        self.graph = self.trees = None
        self.key = None
        self.queued: FrontierTrees | None = None  # the next round's drafting, queued by `launch`

    def step(self):
        """FrontierTrees of the round whose inputs sit in root, start and length."""
        ph, logits = self.backend.draft_block_fixed(self.root, self.start, self.length)
        return self.method.trees(self.backend, Round(ph[None], logits[None], self.root, *self.backend.draft_columns()))

    def __call__(self, root: int, start: int) -> Tree:
        if self.queued is not None:  # queued by the last round, from the bonus and lengths it committed
            trees, self.queued = self.queued, None
            return trees.whole(0)
        self.root.fill_(root)
        self.start.fill_(start)
        self.length.fill_(self.backend.draft_cache.length)
        return self._run().whole(0)

    def launch(self, root: torch.Tensor, start: torch.Tensor, length: torch.Tensor):
        """Queue the next round's drafting from device scalars: its root (the bonus), the root's position and the
        draft cache's committed length, as a fused round leaves them. Only a round whose next round drafts at once
        launches: the loop's next call is that round's (root, start)."""
        self.root.copy_(root.view(1))
        self.start.copy_(start.view(1))
        self.length.copy_(length.view(1))
        self.queued = self._run()

    def cancel(self):
        """Drop a queued drafting (the generation it was queued for has ended)."""
        self.queued = None

    def _run(self) -> FrontierTrees:
        """The step on the inputs as they sit: eagerly off CUDA, else a replay (its outputs are overwritten by the
        next replay: `whole` copies the tree out)."""
        if self.backend.device.type != "cuda":
            return self.step()
        key = self.backend.graph_key()
        if key != self.key:
            self._capture()
            self.key = key
        self.graph.replay()
        return self.trees

    def _capture(self):
        self.graph, self.trees = capture(self.step, device=self.backend.device, flag="--cuda-graph")

"""One round's drafting and DominoTree frontier build as one CUDA graph (`--cuda-graph`, torch backend on CUDA).

Every shape in the step is fixed (the draft block attends over the draft cache's whole capacity by its committed
length, dtrt.models.layers.committed_attention; the frontier has fixed lanes and ledger) and no host value enters
it: root, start and the cache's committed length are device tensors written before each replay. The graph is
captured on the first round and again whenever the draft cache is reallocated. The tree comes out whole, padding
leaves included (FrontierTrees.whole), so nothing is read on the host between drafting and the verify. Off CUDA the
same fixed-shape step runs eagerly, which is how the CPU tests check it.
"""

import torch

from dtrt.tree import Round, Tree


class DraftGraph:
    def __init__(self, backend, method):
        self.backend, self.method = backend, method
        dev = backend.device
        self.root, self.start, self.length = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(3))
        self.graph = self.trees = None
        self.key = None

    def step(self):
        """FrontierTrees of the round whose inputs sit in root, start and length."""
        ph, logits = self.backend.draft_block_fixed(self.root, self.start, self.length)
        return self.method.trees(self.backend, Round(ph[None], logits[None], self.root, *self.backend.draft_columns()))

    def __call__(self, root: int, start: int) -> Tree:
        cache = self.backend.draft_cache
        self.root.fill_(root)
        self.start.fill_(start)
        self.length.fill_(cache.length)
        if self.backend.device.type != "cuda":
            return self.step().whole(0)
        key = self.backend.graph_key()
        if key != self.key:
            self._capture()
            self.key = key
        self.graph.replay()
        return self.trees.whole(0)  # copies of the graph's outputs, which the next replay overwrites

    def _capture(self):
        side = torch.cuda.Stream(self.backend.device)
        side.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(side):  # compiles the Triton kernels and settles the allocator outside the capture
            for _ in range(2):
                self.step()
        torch.cuda.current_stream(self.backend.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.trees = self.step()

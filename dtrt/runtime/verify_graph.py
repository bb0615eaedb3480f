"""`StaticRound`: the torch backend's verify rounds at fixed widths (`--static-shapes`; dtrt.runtime.static_round).
On CUDA each width's T=0 round (verify, accept walk, commit) is one CUDA graph, captured at its first use and again
when the static cache is reallocated, then replayed with the padded tree written into its input buffers; elsewhere
the same function runs eagerly. A round reads back one small tensor: the accepted count and order."""

import torch

from dtrt.runtime.static_round import device_round, padded, verify_at_width, width_for
from dtrt.tree import Tree


class StaticRound:
    def __init__(self, *, target, taps: tuple[int, ...], device: torch.device):
        self.target, self.taps, self.device = target, taps, device
        self.graphs: dict[int, tuple] = {}  # width -> (graph, tokens, parents, outputs)
        self.key = None

    def verify(self, cache, tree: Tree, start: int):
        """The tree's logits and hidden rows [len(tree)] from a padded call; the cache's tail holds its K/V."""
        tokens, parents = (t.to(self.device) for t in padded(tree, width_for(len(tree))))
        logits, hidden, _ = verify_at_width(self.target, cache, self.taps, tokens, parents)
        return logits[: len(tree)], hidden[: len(tree)]

    def commit(self, cache, accepted: list[int], width: int):
        """Commit a verified tree's `accepted` nodes (the host's walk, at T>0) from the tail."""
        rest = sorted(set(range(width)) - set(accepted))
        order = torch.tensor(accepted + rest, device=self.device)
        cache.commit_order(order, torch.tensor(len(accepted), device=self.device))
        cache.past += len(accepted)

    def round(self, cache, tree: Tree):
        """A T=0 round: (logits, hidden) of the tree's rows, the accepted node indices (root first) and the bonus."""
        n, width = len(tree), width_for(len(tree))
        tokens, parents = padded(tree, width)
        if self.device.type == "cuda":
            logits, hidden, order, count, bonus = self._replay(cache, width, tokens, parents)
        else:
            tokens, parents = tokens.to(self.device), parents.to(self.device)
            logits, hidden, order, count, bonus = device_round(self.target, cache, self.taps, tokens, parents)
        read = torch.cat((count[None], bonus[None], order)).tolist()  # the round's one host sync
        count, bonus, order = read[0], read[1], read[2:]
        cache.past += count
        return logits[:n], hidden[:n], order[:count], bonus

    def _replay(self, cache, width, tokens, parents):
        key = (cache.k.data_ptr(), cache.capacity)
        if key != self.key:
            self.graphs.clear()
            self.key = key
        if width not in self.graphs:
            self.graphs[width] = self._capture(cache, tokens.to(self.device), parents.to(self.device))
        graph, tokens_in, parents_in, outputs = self.graphs[width]
        tokens_in.copy_(tokens, non_blocking=True)
        parents_in.copy_(parents, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, cache, tokens, parents):
        """Warm-up calls on a side stream (kernels compiled, the allocator settled), each undone, then the capture."""
        length = cache.length.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                device_round(self.target, cache, self.taps, tokens, parents)
                cache.length.copy_(length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = device_round(self.target, cache, self.taps, tokens, parents)  # recorded, not run
        return graph, tokens, parents, outputs

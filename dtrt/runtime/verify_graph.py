"""`StaticRound`: the torch backend's verify rounds at fixed widths (`--static-shapes`; dtrt.runtime.static_round).
On CUDA each width's round (verify, accept walk, commit, the drafter's context of the accepted rows; at T>0 every
row's draw too, one graph per sampling mode) is one CUDA graph, and so is each width's verify alone (what a round
under a grammar runs before the host walk), captured at first use and again when the static cache or the draft
cache is reallocated (the layers' parts around attention compiled by torch.compile first, unless --no-compile:
StaticKVCache.run_layer), then replayed with the padded tree written into its input buffers; elsewhere the same
functions run eagerly. A round reads back one small tensor: the accepted count, the bonus token, the order and the
walked nodes' tokens. The host's lengths (the target's past, the draft cache's length) stay the ones the rest of the
loop reads: the device's are set from them before each round and the host's advanced by the count read back."""

import torch

from dtrt.runtime.capture import capture
from dtrt.runtime.sampling import Draws
from dtrt.runtime.static_round import WIDTHS, ContextAppend, Sampled, device_round, padded, verify_at_width, width_for
from dtrt.tree import Tree


class StaticRound:
    def __init__(self, *, target, taps: tuple[int, ...], device: torch.device):
        self.target, self.taps, self.device = target, taps, device
        # (step, width, the draft cache's buffer or None, sampling mode or None) -> (graph, tokens, parents, outputs)
        self.graphs: dict[tuple, tuple] = {}
        self.key = None
        self.host: dict[int, torch.Tensor] = {}  # pinned read-back buffers, by size (CUDA)
        # T>0: the generation's uniforms by position and its sampling scalars, as the graphs read them
        self.uniforms = torch.zeros(0, dtype=torch.float64, device=device)
        self.temperature, self.top_p = (torch.ones((), device=device) for _ in range(2))
        self.drawn: Draws | None = None
        self.pinned: torch.Tensor | None = None  # the table's host copy while it goes to the device (CUDA)

    def verify(self, cache, tree: Tree, start: int):
        """The tree's logits and hidden rows [len(tree)] from a padded call; the cache's tail holds its K/V."""
        n = len(tree)

        def step(tokens, parents):
            return verify_at_width(self.target, cache, self.taps, tokens, parents)[:2]

        self._buffers(cache)
        logits, hidden = self._run(("verify", width_for(n), None, None), step, cache, None, *padded(tree, width_for(n)))
        return logits[:n], hidden[:n]

    def commit(self, cache, accepted: list[int], width: int):
        """Commit a verified tree's `accepted` nodes (the host's walk, at T>0) from the tail."""
        rest = sorted(set(range(width)) - set(accepted))
        order = torch.tensor(accepted + rest, device=self.device)
        cache.commit_order(order, torch.tensor(len(accepted), device=self.device))
        cache.past += len(accepted)

    def round(self, cache, tree: Tree, context: ContextAppend | None = None, ahead=None, draws: Draws | None = None):
        """A round: (logits, hidden) of the tree's rows, the accepted node indices (root first), the bonus and
        the tokens the round commits (the accepted nodes' after the root, then the bonus: read back with the count,
        so the loop reads nothing of a tree that is still on the device); with `draws` (T>0) every row's token drawn
        on the device at the position it lands at; with a `context`, the accepted rows' drafter context appended to
        its cache, and with a drafting graph `ahead` (dtrt.runtime.draft_graph) the next round's drafting queued
        from the round's bonus and lengths before the host waits for the read-back."""
        n, width = len(tree), width_for(len(tree))
        self._buffers(cache)
        if context is not None:
            context.length.fill_(context.cache.length)
        sampled = self._sampled(draws)

        def step(tokens, parents):
            out = device_round(self.target, cache, self.taps, tokens, parents, context, sampled)
            logits, hidden, order, count, bonus = out
            return logits, hidden, order, count, bonus, tokens.index_select(0, order)

        mode = None if sampled is None else "nucleus" if sampled.nucleus else "sample"
        key = ("round", width, context.cache.k.data_ptr() if context is not None else None, mode)
        logits, hidden, order, count, bonus, walked = self._run(key, step, cache, context, *padded(tree, width))
        read = self._read(torch.cat((count[None], bonus[None], order, walked)))
        if ahead is not None and context is not None:
            ahead.launch(bonus, cache.length, context.length)
        read = read()  # the round's one host sync
        count, bonus, order, walked = read[0], read[1], read[2 : 2 + width], read[2 + width :]
        cache.past += count
        if context is not None:
            context.cache.length += count
        return logits[:n], hidden[:n], order[:count], bonus, walked[1:count] + [bonus]

    def _buffers(self, cache):
        """On a new static cache (another buffer or capacity): its graphs go, and the uniforms' table is sized for
        every position a round at its capacity can draw at."""
        buffers = (cache.k.data_ptr(), cache.capacity)
        if buffers != self.key:
            self.graphs.clear()
            self.key = buffers
            self.uniforms = torch.zeros(cache.capacity + WIDTHS[-1] + 1, dtype=torch.float64, device=self.device)
            self.drawn = None

    def _sampled(self, draws: Draws | None) -> Sampled | None:
        """The round's T>0 draws over the device's table, written when a generation's draws first come (a copy of
        the table and the two scalars; the graphs read them where they are)."""
        if draws is None:
            return None
        if draws is not self.drawn:
            table = torch.from_numpy(draws.table(self.uniforms.numel())[: self.uniforms.numel()])
            if self.device.type == "cuda":  # queued from pinned memory, not a copy that waits for the device
                table = self.pinned = table.pin_memory()
            self.uniforms.copy_(table, non_blocking=True)
            self.temperature.fill_(draws.cfg.temperature)
            self.top_p.fill_(draws.cfg.top_p)
            self.drawn = draws
        return Sampled(self.uniforms, self.temperature, self.top_p, nucleus=draws.cfg.top_p < 1.0)

    def _read(self, values: torch.Tensor):
        """A function that returns `values` as a list. On CUDA the copy to pinned host memory is queued now and
        the function waits for it alone, not for device work queued after it (the next round's drafting)."""
        if self.device.type != "cuda":
            return values.tolist
        host = self.host.get(values.numel())
        if host is None:
            host = self.host[values.numel()] = torch.empty(values.numel(), dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read():
            done.synchronize()
            return host.tolist()

        return read

    def _run(self, key, step, cache, context, tokens, parents):
        """`step(tokens, parents)` on the device: eagerly off CUDA, else the replay of its graph under `key`."""
        if self.device.type != "cuda":
            return step(tokens.to(self.device), parents.to(self.device))
        if key not in self.graphs:
            if key[2] is not None:  # a reallocated draft cache's graphs go
                for stale in [g for g in self.graphs if g[2] not in (None, key[2])]:
                    del self.graphs[stale]
            self.graphs[key] = self._capture(step, cache, context, tokens.to(self.device), parents.to(self.device))
        graph, tokens_in, parents_in, outputs = self.graphs[key]
        tokens_in.copy_(tokens, non_blocking=True)
        parents_in.copy_(parents, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, step, cache, context, tokens, parents):
        """The step's graph over these input buffers; each warm-up call's advance of the lengths undone."""
        lengths = [cache.length] + ([context.length] if context is not None else [])
        saved = [t.clone() for t in lengths]

        def undo():
            for length, was in zip(lengths, saved):
                length.copy_(was)

        graph, outputs = capture(lambda: step(tokens, parents), device=self.device, flag="--static-shapes", undo=undo)
        return graph, tokens, parents, outputs

"""The one decode loop: draft -> build -> verify -> accept -> commit, for every method and backend, as a stream of
rounds. `generate` yields a Step per round (the prefill's first token, then each verify round's committed tokens);
whoever iterates it decides when to stop early (stop strings, Ctrl-C, a cancelled request): it stops iterating.
Asked for (`logprobs`), a Step also carries the target's log-probabilities of its tokens, taken from the logits the
target computed anyway (the prefill's last row, the verify rows of the accepted path)."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dtrt.runtime.backends.base import Backend
from dtrt.runtime.grammar import Grammar, GrammarState
from dtrt.runtime.methods import Method
from dtrt.runtime.prefix_cache import PrefixCache, boundaries, cacheable, kept, prefill, restore
from dtrt.runtime.sampling import Draws, SamplingConfig, chooser
from dtrt.runtime.spec import RunSpec
from dtrt.tree import Tree, accept, first_nodes
from dtrt.tree.grammar import fit_tree, paths

STAGES = ("draft", "build", "verify", "commit")


@dataclass
class RoundStats:
    accepted: int  # accepted draft nodes + 1 (the bonus token): this round's tau
    tree_size: int  # verify width, root included
    draft_s: float
    build_s: float
    verify_s: float
    commit_s: float
    lookup: int = 0  # accepted draft nodes that came from lookup (--method lookup: all of them; --lookup)


MAX_TOP_LOGPROBS = 20  # alternatives per token at most, as OpenAI's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token: log_softmax of the target's own logits in fp32, before
    temperature and top-p (the model's distribution, whatever the sampling), and the `k` most likely tokens there."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(logits, tokens: list[int], k: int) -> list[TokenLogprob]:
    """The log-probability of tokens[i] under row i of `logits` [len(tokens), V], and each row's top `k`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(c) for c in chosen]
    values, ids = lp.topk(k, dim=-1)
    return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


@dataclass
class Step:
    """What one round committed."""

    tokens: list[int]  # cut after an EOS token and at max_new_tokens
    stats: RoundStats | None = None  # None: the token chosen at prefill
    prefill_s: float = 0.0  # on the prefill step: prompt forward, first choice, drafter context
    cached: int = 0  # on the prefill step: prompt positions restored from the prefix cache
    saved_s: float = 0.0  # and the prefill time they took, less the restore's
    end: str | None = None  # "eos" or "length" when the generation ends with this step
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt positions restored from the prefix cache
    prefill_saved_s: float = 0.0  # the prefill time they saved
    decode_s: float = 0.0
    stop_reason: str = "length"  # "eos" | "length" | "stop" | "cancelled" (the last two: set by the consumer)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the stream carries them
    _decode_t0: float = field(default=0.0, repr=False)

    def add(self, step: Step):
        """Take one step of the stream; decode time runs from the prefill step to the last step taken."""
        now = time.perf_counter()
        self.tokens += step.tokens
        if step.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(step.logprobs)
        if step.stats is None:
            self.prefill_s, self._decode_t0 = step.prefill_s, now
            self.cached_tokens, self.prefill_saved_s = step.cached, step.saved_s
        else:
            self.rounds.append(step.stats)
            self.decode_s = now - self._decode_t0
        if step.end is not None:
            self.stop_reason = step.end

    def keep(self, n: int):
        """Keep the first `n` tokens (and their logprobs): what a stop string leaves."""
        self.tokens = self.tokens[:n]
        if self.logprobs is not None:
            self.logprobs = self.logprobs[:n]

    def stats(self) -> dict:
        """What `dtrt run --json` and `dtrt bench` report of a generation: tokens, tau, rates, times, stop reason,
        per-stage totals and per-round acceptance (and how many of the accepted drafts came from --lookup)."""
        return {
            "tokens": self.tokens,
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "rounds": len(self.rounds),
            "prefill_s": self.prefill_s,
            "cached_tokens": self.cached_tokens,
            "prefill_saved_s": self.prefill_saved_s,
            "decode_s": self.decode_s,
            "stop_reason": self.stop_reason,
            "stage_s": {k: sum(getattr(r, f"{k}_s") for r in self.rounds) for k in STAGES},
            "accepted": [r.accepted for r in self.rounds],
            "tree_sizes": [r.tree_size for r in self.rounds],
            "from_lookup": [r.lookup for r in self.rounds],
        }

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (accepted drafts + bonus)."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over decode time (the clock starts after prefill)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0


def choose(logits, draws: Draws | None, state, node_paths, position):
    """The target's choice at each node (`chooser`), under the grammar's mask at the node's path where there is one;
    at T>0 the token after node i is drawn at `position(i)`."""
    if state is None:
        return chooser(logits, draws, position)
    if draws is None:
        return lambda i: state.greedy(logits[i], node_paths[i])

    def sample(i):  # a forced token is taken, not drawn
        forced = state.forced(node_paths[i])
        if forced is not None:
            return forced
        return draws.draw(state.masked(logits[i], node_paths[i]), position(i))

    return sample


def after(tree: Tree, start: int):
    """position(i): where the token after node i of `tree` (rooted at `start`) lands; the depths read on first use."""
    depths = []

    def position(i: int) -> int:
        if not depths:
            depths.extend(tree.depths.tolist())
        return start + depths[i] + 1

    return position


def flush(backend, pending: list[tuple[torch.Tensor, torch.Tensor]]):
    """The drafter's context of the committed rows it has not read yet, appended in one call."""
    if pending:
        hidden_rows, positions = (torch.cat(x) for x in zip(*pending)) if len(pending) > 1 else pending[0]
        backend.draft_context(hidden_rows, positions)
        pending.clear()


def capacity_for(prompt_len: int, max_new_tokens: int, budget: int, block_size: int) -> int:
    return prompt_len + max_new_tokens + max(budget, block_size) + 2


def collect(steps: Iterator[Step]) -> Generation:
    """The whole stream as one Generation."""
    out = Generation()
    for step in steps:
        out.add(step)
    return out


@torch.no_grad()
def generate(
    backend: Backend,
    method: Method,
    prompt: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos: tuple[int, ...] = (),
    budget: int = RunSpec.budget,
    logprobs: int | None = None,
    grammar: Grammar | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[Step]:
    """Up to `max_new_tokens` tokens after `prompt`, one Step per round; with `logprobs` k (0..MAX_TOP_LOGPROBS)
    each Step carries its tokens' TokenLogprobs with the top k alternatives (None: none, nothing computed).
    With a `grammar` (structured output) every choice is the target's under the grammar's mask at its path: trees
    hold only allowed and forced tokens (dtrt.tree.grammar), so the output is AR's under the same grammar.
    With a `prefix_cache` the prompt's longest cached prefix is restored, not prefilled (dtrt.runtime.prefix_cache)."""
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs {logprobs}: must be in [0, {MAX_TOP_LOGPROBS}]")
    drafter = backend.drafter if method.uses_drafter else None
    block = drafter.cfg.block_size if drafter is not None else 1
    method.calibrate(backend)
    capacity = capacity_for(len(prompt), max_new_tokens, budget, block)
    backend.reset(capacity)
    draws = Draws(sampling, capacity + 1) if sampling.temperature > 0 else None  # a uniform per position
    produced = 0

    def cut(tokens: list[int]) -> tuple[list[int], str | None]:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1][: max_new_tokens - produced], "eos"
        tokens = tokens[: max_new_tokens - produced]
        return tokens, "length" if produced + len(tokens) >= max_new_tokens else None

    t0 = time.perf_counter()
    n = len(prompt)
    owner = object()
    if prefix_cache is not None:
        prefix_cache.owner = owner
    ends = boundaries(prompt, eos) if cacheable(backend) else None  # where the prefill's calls end
    hit, took = restore(backend, prefix_cache, prompt, n - 1, ends)  # the first choice comes from a real forward
    logits, _ = prefill(backend, prompt, hit.tokens, drafter is not None, ends)
    state = method.grammar = None if grammar is None else GrammarState(grammar, logits.shape[-1])
    root = choose(logits[-1:], draws, state, [()], lambda _: n)(0)
    if state is not None and root not in eos:
        state.commit([root])
    method.begin(prompt, hit.index, sampled=draws is not None)
    if drafter is not None:
        method.prepare(backend, drafter.cfg.k_draft)
    tokens, end = cut([root])
    produced += len(tokens)
    lps = token_logprobs(logits[-1:], tokens, logprobs) if logprobs is not None else None
    prefill_s = time.perf_counter() - t0
    keep = kept(ends) if prefix_cache is not None else 0
    kept_s = took + prefill_s * (keep - hit.tokens) / (n - hit.tokens) if keep > hit.tokens else 0.0
    stands = False  # whether the prompt's positions are still the prefill's when the generation ends
    try:
        yield Step(tokens, prefill_s=prefill_s, end=end, logprobs=lps, cached=hit.tokens, saved_s=hit.saved_s)
        # the committed rows the drafter has not read yet: its context is brought up to date only in a round that
        # drafts, in one call, so rounds that verify the root alone (cadominotree's gate) cost what an AR step costs
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        while end is None:
            t0 = time.perf_counter()
            start = backend.past
            # where the grammar forces the root's next token, the tree is its forced tokens (fit_tree): no drafting
            # (a cost-aware method times every round it is asked about, so it is always asked)
            forced = state is not None and not method.cost_aware and state.forced(()) is not None
            if forced:
                t1 = time.perf_counter()
                tree = Tree.chain([], root=root)
            elif method.drafts(start, root):
                flush(backend, pending)
                tree, t1 = method.draft(backend, root, start)
            else:
                t1 = time.perf_counter()
                tree = method.undrafted(root)  # lookup's chain, proposed in drafts(), or the root alone
            if (limit := backend.max_depth(start)) is not None:
                tree = tree.within(limit)
            if state is not None:
                tree = fit_tree(tree, state, room=max(budget, len(tree) - 1), max_depth=limit)
            t2 = time.perf_counter()
            fused = None
            if state is None and backend.fuses(tree):
                flush(backend, pending)  # rows of a round it could not take (wider than its widths), before its own
                # the next round drafts at once where this one is fused: no lookup, no grammar (DominoTree's graph)
                fused = backend.fused_round(tree, context=drafter is not None, ahead=method.graph, draws=draws)
            if fused is not None:  # verify, accept walk, commit, drafter context as one device step (--static-shapes)
                logits, hidden, accepted, bonus, committed = fused
            else:
                logits, hidden = backend.verify(tree, start)
                choice = choose(logits, draws, state, paths(tree) if state else None, after(tree, start))
                accepted, bonus = accept(tree, choice)
                committed = tree.tokens[accepted[1:]].tolist() + [bonus]
            from_lookup = method.observe(tree, accepted) or 0
            t3 = time.perf_counter()
            if fused is None:
                backend.commit(accepted)
            if drafter is not None and fused is None:
                a = len(accepted)
                # a copy: the stage's outputs are valid until its next call, and a round without drafts keeps them
                rows = hidden[:a].clone() if first_nodes(accepted) else hidden[torch.tensor(accepted)]
                pending.append((rows, torch.arange(start, start + a)))
            t4 = time.perf_counter()
            stats = RoundStats(len(accepted), len(tree), t1 - t0, t2 - t1, t3 - t2, t4 - t3, from_lookup)
            tokens, end = cut(committed)
            if state is not None and end is None:
                state.commit(tokens)
            produced += len(tokens)
            lps = None
            if logprobs is not None:  # each committed token is chosen at its parent: the accepted nodes' rows
                rows = torch.tensor(accepted[: len(tokens)], device=logits.device)
                lps = token_logprobs(logits[rows], tokens, logprobs)
            yield Step(tokens, stats, end=end, logprobs=lps)
            root = bonus
        stands = True
    except GeneratorExit:  # its consumer stopped it (a stop string, a cancelled request): rounds only append
        stands = True
        raise
    finally:
        # the prompt's snapshot is copied after the last round, out of the rounds' time; by the generation that
        # owns the backend's state (a generator closed late, after another one began, keeps nothing)
        if stands and keep > hit.tokens and prefix_cache.owner is owner:
            index = method.lookup_index()
            index = index.fork(keep) if index is not None else None
            prefix_cache.store(prompt[:keep], backend.snapshot(keep), kept_s, index)

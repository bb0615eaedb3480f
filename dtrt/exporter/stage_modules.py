"""The exported stages (DESIGN.md section 2) as PyTorch wrapper modules with named inputs and outputs.

These wrappers are what gets exported and what `dtrt parity` compares ONNX Runtime against, on the same inputs.

    target          ids [N], positions [N], mask [N, N], past_k/past_v [L, KVH, C, HD] (the cache, capacity C),
                    past_positions [P] (P <= C: the past is the cache's first P positions; only its length is read)
                    -> logits [N, V] fp32, hidden [N, taps*H], new_k/new_v [L, KVH, N, HD]
                    hybrid: L counts the full-attention layers; also parents [N] (-1 for the root),
                    state [R, Hv, dk, dv] fp32, conv [R, C, K-1] in (R Gated-DeltaNet layers)
                    -> also states [R, N, Hv, dk, dv], windows [R, N, C, K-1] (after each node)
    drafter_context hidden [n, taps*H], positions [n] -> ctx_k/ctx_v [Ld, KVHd, n, HDd]
    drafter_block   root [1], start [1], rows [1] (1..D), then per draft layer l cache_k<l>/cache_v<l>
                    [P, KVHd, HDd] (position-major) -> ph [rows, H], base [rows, V'] fp32
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from dtrt.models.draft_vocab import DraftHead, DraftVocab
from dtrt.models.drafter import Drafter, block_cache_inputs
from dtrt.models.hybrid import HybridTarget, tree_parents
from dtrt.models.target import Target


class ConcatCache:
    """The cache seen by an exported target: the runtime's whole cache buffer comes in (its past the first P
    positions, P the length of past_positions), only the new K/V go out. The runtime appends in place, so no call
    re-spaces the cache; each layer reads its past with one Slice (dtrt.exporter.graph_passes.slice_past)."""

    def __init__(self, past_k, past_v, past_positions):
        self.past = past_positions.shape[0]
        torch._check(self.past <= past_k.shape[2])
        self.past_k, self.past_v = past_k.narrow(2, 0, self.past), past_v.narrow(2, 0, self.past)
        self.new_k, self.new_v = [], []

    def update(self, layer, k, v):
        self.new_k.append(k)
        self.new_v.append(v)
        return torch.cat((self.past_k[layer], k), dim=-2), torch.cat((self.past_v[layer], v), dim=-2)

    def past_mask(self, mask):
        return mask.new_ones(*mask.shape[:-1], self.past)


class TargetStage(nn.Module):
    def __init__(self, target: Target, taps: tuple[int, ...]):
        super().__init__()
        self.target, self.taps = target, tuple(taps)

    def forward(self, ids, positions, mask, past_k, past_v, past_positions):
        cache = ConcatCache(past_k, past_v, past_positions)
        logits, hidden = self.target(ids, positions, mask, cache, taps=self.taps)
        return logits, hidden, torch.stack(cache.new_k), torch.stack(cache.new_v)


class ConcatHybridCache(ConcatCache):
    """A hybrid target's exported cache: also the committed recurrent states and conv windows come in, and every
    node's state and window go out (the runtime's commit picks the last accepted node's)."""

    def __init__(self, past_k, past_v, past_positions, state, conv):
        super().__init__(past_k, past_v, past_positions)
        self.state, self.conv = state, conv
        self.node_states, self.node_windows = [], []

    def recurrent(self, layer):
        return self.state[layer], self.conv[layer]

    def keep(self, layer, states, windows):
        self.node_states.append(states)
        self.node_windows.append(windows)


class HybridTargetStage(TargetStage):
    def forward(self, ids, positions, mask, parents, past_k, past_v, past_positions, state, conv):
        cache = ConcatHybridCache(past_k, past_v, past_positions, state, conv)
        logits, hidden = self.target(ids, positions, mask, cache, parents, taps=self.taps)
        return (
            logits,
            hidden,
            torch.stack(cache.new_k),
            torch.stack(cache.new_v),
            torch.stack(cache.node_states),
            torch.stack(cache.node_windows),
        )


class DrafterContextStage(nn.Module):
    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, hidden, positions):
        kv = self.drafter.context_kv(hidden, positions)
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


class DrafterBlockStage(nn.Module):
    """The block forward with the target's embedding and lm_head folded in (the drafter shares them). The whole
    block runs (every slot attends to every other), but only its first `rows` proposal rows leave it: a round's tree
    reaches no deeper, and the lm_head over the others was most of the stage's cost."""

    def __init__(self, target: Target, drafter: Drafter, vocab: DraftVocab | None = None):
        super().__init__()
        self.drafter = drafter
        self.embed = target.model.embed_tokens
        self.head = DraftHead(target.lm_head, vocab)
        cfg = drafter.cfg
        self.register_buffer("slots", torch.arange(cfg.block_size), persistent=False)
        self.register_buffer("mask_ids", torch.full((cfg.block_size - 1,), cfg.mask_token_id), persistent=False)

    def forward(self, root, start, rows, *cache):
        """`cache`: block_cache_inputs' tensors, one [P, KVH, HD] K and V per draft layer. Read position-major, each
        layer's own input: ONNX Runtime folds their transposes into its products, so no call copies the context
        (a cache stacked over layers was split by layer, a copy of it all on every call), and the runtime appends
        to them without moving what is stored."""
        ids = torch.cat((root, self.mask_ids))
        x = self.embed(ids).to(self.drafter.dtype)
        kv = [(k.transpose(0, 1), v.transpose(0, 1)) for k, v in zip(cache[0::2], cache[1::2])]
        ph = self.drafter.proposal_rows(self.drafter.block(x, start + self.slots, kv))
        n = rows[0].item()
        torch._check(n >= 1)
        torch._check(n <= ph.shape[0])
        ph = ph.narrow(0, 0, n)
        return ph, self.head(ph)


@dataclass
class Stage:
    name: str
    module: nn.Module
    inputs: list[str]
    outputs: list[str]
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)  # input -> {axis: dim name}
    make_example: object = None  # (stage, n, p, gen) -> inputs
    # output -> {axis: dim name} for dims an input's value sets (the exporter names them u0, u1, ... otherwise)
    output_dims: dict[str, dict[int, str]] = field(default_factory=dict)

    def example(self, n: int, p: int, gen: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Random inputs with n new tokens (or context rows) over a past of p positions."""
        return self.make_example(self, n, p, gen)


def random_tree_mask(n, gen):
    """A random tree over n tokens (node 0 the root; parents precede children): depths and ancestor mask."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return torch.tensor(depth), mask


def _target_example(stage, n, p, gen, kv_layers: int | None = None):
    t = stage.module.target
    cfg, dtype = t.cfg, t.dtype
    depth, mask = random_tree_mask(n, gen)
    # a cache with room to spare: the stage reads only its first p positions
    kv = (cfg.num_layers if kv_layers is None else kv_layers, cfg.num_kv_heads, p + n + 2, cfg.head_dim)
    return {
        "ids": torch.randint(0, cfg.vocab_size, (n,), generator=gen),
        "positions": p + depth,
        "mask": mask,
        "past_k": torch.randn(kv, generator=gen).to(dtype),
        "past_v": torch.randn(kv, generator=gen).to(dtype),
        "past_positions": torch.arange(p),
    }


def _hybrid_target_example(stage, n, p, gen):
    t = stage.module.target
    cfg = t.cfg
    example = _target_example(stage, n, p, gen, kv_layers=len(cfg.attention_layers))
    layers = len(cfg.recurrent_layers)
    state = (layers, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = (layers, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    return example | {
        "parents": tree_parents(example["mask"]),
        "state": torch.randn(state, generator=gen),
        "conv": torch.randn(conv, generator=gen).to(t.dtype),
    }


def _context_example(stage, n, p, gen):
    d = stage.module.drafter
    width = d.fc.in_features
    return {"hidden": torch.randn(n, width, generator=gen).to(d.dtype), "positions": torch.arange(p, p + n)}


def _block_example(stage, n, p, gen):
    """n: the rows asked for (at most k_draft)."""
    d = stage.module.drafter
    cfg = d.cfg
    kv = (p, cfg.num_kv_heads, cfg.head_dim)
    return {
        "root": torch.randint(0, cfg.vocab_size, (1,), generator=gen),
        "start": torch.tensor([p]),
        "rows": torch.tensor([min(n, cfg.k_draft)]),
        **{name: torch.randn(kv, generator=gen).to(d.dtype) for name in block_cache_inputs(cfg.num_layers)},
    }


# the target's dynamic dims: N new tokens, C the cache's capacity, P the past's length
TARGET_DIMS = {
    "ids": {0: "N"},
    "positions": {0: "N"},
    "mask": {0: "N", 1: "N"},
    "past_k": {2: "C"},
    "past_v": {2: "C"},
    "past_positions": {0: "P"},
}


def target_stage(target: Target, taps: tuple[int, ...]) -> Stage:
    """The target's stage, returning the outputs of the decoder layers `taps` as its hidden states."""
    if isinstance(target, HybridTarget):
        return Stage(
            "target",
            HybridTargetStage(target, taps),
            ["ids", "positions", "mask", "parents", "past_k", "past_v", "past_positions", "state", "conv"],
            ["logits", "hidden", "new_k", "new_v", "states", "windows"],
            TARGET_DIMS | {"parents": {0: "N"}},
            _hybrid_target_example,
        )
    return Stage(
        "target",
        TargetStage(target, taps),
        ["ids", "positions", "mask", "past_k", "past_v", "past_positions"],
        ["logits", "hidden", "new_k", "new_v"],
        TARGET_DIMS,
        _target_example,
    )


def drafter_stages(target: Target, drafter: Drafter, kind: str, vocab: DraftVocab | None = None) -> list[Stage]:
    """`<kind>.context` and `<kind>.block` for a drafter (kind: dflash or domino); the block's base logits cover
    `vocab` (None: the whole vocabulary)."""
    return [
        Stage(
            f"{kind}.context",
            DrafterContextStage(drafter),
            ["hidden", "positions"],
            ["ctx_k", "ctx_v"],
            {"hidden": {0: "N"}, "positions": {0: "N"}},
            _context_example,
        ),
        Stage(
            f"{kind}.block",
            DrafterBlockStage(target, drafter, vocab),
            ["root", "start", "rows", *block_cache_inputs(drafter.cfg.num_layers)],
            ["ph", "base"],
            {name: {0: "P"} for name in block_cache_inputs(drafter.cfg.num_layers)},
            _block_example,
            {"ph": {0: "R"}, "base": {0: "R"}},
        ),
    ]

"""The PyTorch backend: the reference implementation of every stage of DESIGN.md section 2, on the CPU or a CUDA
device. On CUDA the dtrt ops run their Triton kernels (dtrt.ops.kernels); the decode loop hands in host tensors
and gets logits and drafter rows back on the device."""

from pathlib import Path

import torch

from dtrt.artifacts.files import sha256
from dtrt.errors import DtrtError
from dtrt.models.checkpoint import check_pair, load_drafter, load_target, parse_dtype
from dtrt.models.config import read_json
from dtrt.models.draft_vocab import DraftHead, DraftVocab, check_vocab_size, resolve_draft_vocab
from dtrt.models.drafter import DraftCache, Drafter
from dtrt.models.gguf_blocks import require_blocks
from dtrt.models.quant import dequantized
from dtrt.models.quant_spec import GgufQuant, quant_spec
from dtrt.models.static_kv import StaticKVCache
from dtrt.models.target import KVCache, Target
from dtrt.runtime.backends.base import Backend, check_rows
from dtrt.runtime.static_round import WIDTHS, ContextAppend, width_for
from dtrt.runtime.verify_graph import StaticRound
from dtrt.scoring import CondStaticScorer, DominoScorer, domino_chain
from dtrt.tree import FrontierTrees, MarginalScorer, Round, build_frontier


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        device: str | torch.device | None = None,
        max_context: int | None = None,
        context_source: str = "",
        draft_vocab: DraftVocab | None = None,
    ):
        """The models are moved to `device` (default: where the target is); the target taps the layers the drafter
        reads; the drafter's base logits cover `draft_vocab` (None: the whole vocabulary)."""
        self.device = torch.device(device) if device is not None else target.lm_head.weight.device
        self.target = target.to(self.device)
        self.drafter = drafter.to(self.device) if drafter is not None else None
        self.draft_vocab = draft_vocab
        self.draft_head = DraftHead(self.target.lm_head, draft_vocab) if drafter is not None else None
        self.taps = tuple(drafter.cfg.target_layer_ids) if drafter is not None else ()
        self.max_context, self.context_source = max_context, context_source
        self.cache: KVCache | None = None
        self.draft_cache: DraftCache | None = None
        self.static: StaticRound | None = None  # --static-shapes: verify at fixed widths over a static cache
        self.compile_layers = False  # --static-shapes on CUDA: the static cache's layers run compiled (--compile)
        self._verified = 0  # the width of the last static verify, which commit reads from
        self._context: ContextAppend | None = None  # a static round's drafter context append, per draft cache

    def prepare(self, spec):
        """--static-shapes: the target's K/V in one buffer for the context limit, verify at fixed widths."""
        if spec.static_shapes and self.static is None:
            if type(self.target) is not Target:
                raise DtrtError(
                    "--static-shapes: a dense target's verify at fixed widths; this target's recurrent layers "
                    "have no static verify yet (drop --static-shapes)"
                )
            self.static = StaticRound(target=self.target, taps=self.taps, device=self.device)
            self.compile_layers = spec.compile and self.device.type == "cuda"

    @classmethod
    def open(cls, spec, sources):
        """The spec's checkpoints loaded at --dtype, the target's weights dequantized as --quant says, the drafter the
        method needs checked against the target, and its draft vocabulary resolved."""
        pair = sources.pair
        dtype = parse_dtype(spec.dtype or "fp32")
        quant = quant_spec(spec.quant or "none")
        if isinstance(quant, GgufQuant):
            require_blocks(pair.target)  # the checkpoint is its GGUF file's blocks dequantized
        target = dequantized(load_target(pair.target, dtype), quant)
        drafter = None
        if spec.uses_drafter:
            path = pair.drafter_for(spec.needs_head)
            if path is None:
                kind = "Domino" if spec.needs_head else "DFlash"
                raise DtrtError(
                    f"--method {spec.method}: no {kind} drafter found for {pair.target}; pass --drafter DIR"
                )
            drafter = load_drafter(path, dtype)
            check_pair(target, drafter, path)
            if spec.needs_head and drafter.head is None:
                raise DtrtError(
                    f"{path}: a DFlash checkpoint with no Domino head (prefix_gru.*, embed_proj.*); "
                    f"--method {spec.method} needs a Domino drafter (or use dflash, ddtree, caddtree)"
                )
        config = Path(pair.target) / "config.json"
        limit = read_json(config).get("max_position_embeddings")
        vocab = None
        if drafter is not None:
            tokenizer_json = Path(pair.target) / "tokenizer.json"
            vocab = resolve_draft_vocab(
                spec.draft_vocab,
                path,
                target.cfg.vocab_size,
                target.cfg.eos_token_id,
                sha256(tokenizer_json) if tokenizer_json.is_file() else None,
            )
        check_vocab_size(vocab, spec.topm, spec.node_topk)
        return cls(target, drafter, spec.device, limit, f"max_position_embeddings in {config}", vocab)

    @property
    def past(self) -> int:
        return self.cache.past

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def reset(self, capacity: int):
        if self.cache is None or self.cache.capacity < capacity:
            if self.static is not None:  # allocated once for the context limit (or a longer generation's need)
                size = max(capacity, self.max_context or 0)
                target = self.target
                compiled = self.compile_layers
                self.cache = StaticKVCache(target.cfg, size, WIDTHS[-1], target.dtype, self.device, compiled)
            else:
                self.cache = self.target.new_cache(capacity)
        if self.drafter is not None:
            # static: the target's capacity, and the slack a round's context append writes past the length
            need = self.cache.capacity + WIDTHS[-1] if self.static is not None else capacity
            if self.draft_cache is None or self.draft_cache.capacity < need:
                self.draft_cache = DraftCache(self.drafter.cfg, need, self.drafter.dtype, self.device)
                self._context = None
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()

    # target stages
    @torch.no_grad()
    def target_forward(self, ids, positions, mask):
        dev = self.device
        return self.target(ids.to(dev), positions.to(dev), mask.to(dev), self.cache, taps=self.taps)

    def commit(self, accepted):
        if self._verified:
            self.static.commit(self.cache, list(accepted), self._verified)
            self._verified = 0
        else:
            self.cache.commit(accepted)

    @torch.no_grad()
    def verify(self, tree, start: int):
        if self.static is None or len(tree) > WIDTHS[-1]:
            return super().verify(tree, start)
        self._verified = width_for(len(tree))
        return self.static.verify(self.cache, tree, start)

    def fuses(self, tree) -> bool:
        return self.static is not None and len(tree) <= WIDTHS[-1]

    @torch.no_grad()
    def fused_round(self, tree, *, context: bool = False, ahead=None, draws=None):
        if context and self._context is None:
            self._context = ContextAppend(self.drafter, self.draft_cache)
        return self.static.round(self.cache, tree, self._context if context else None, ahead, draws)

    # drafter stages
    @torch.no_grad()
    def draft_context(self, hidden, positions):
        kv = self.drafter.context_kv(hidden.to(self.device, self.drafter.dtype), positions.to(self.device))
        self.draft_cache.append_layers(kv)

    @torch.no_grad()
    def draft_block(self, root: int, start: int, *, rows: int):
        cfg = self.drafter.cfg
        check_rows(rows, cfg.k_draft)
        ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long)
        ids[0] = root
        positions = torch.arange(start, start + cfg.block_size, device=self.device)
        ctx = [self.draft_cache.layer(i) for i in range(cfg.num_layers)]
        return self._block(ids.to(self.device), positions, ctx, rows=rows)

    @torch.no_grad()
    def draft_block_fixed(self, root: torch.Tensor, start: torch.Tensor, length: torch.Tensor):
        """draft_block of every row (k_draft) with fixed shapes and no host values, for a CUDA graph: root, start and
        the committed length of the draft cache are device tensors [1], and attention spans the cache's whole
        capacity, of which it sees the committed entries (committed_attention; the block's own columns always)."""
        cfg, cache = self.drafter.cfg, self.draft_cache
        b = cfg.block_size
        ids = torch.cat((root, torch.full((b - 1,), cfg.mask_token_id, dtype=torch.long, device=self.device)))
        positions = start + torch.arange(b, device=self.device)
        ctx = [(cache.k[i], cache.v[i]) for i in range(cfg.num_layers)]
        return self._block(ids, positions, ctx, length=length)

    def graph_key(self) -> tuple:
        """What a captured drafting graph depends on: the draft cache's buffers (re-captured when they change)."""
        cache = self.draft_cache
        return (cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity)

    def draft_columns(self):
        return self.draft_head.columns() if self.draft_head is not None else (None, None)

    def _block(self, ids, positions, ctx, length=None, rows: int | None = None):
        """The block's first `rows` proposal rows (None: all) and their base logits."""
        x = self.target.model.embed_tokens(ids).to(self.drafter.dtype)
        ph = self.drafter.proposal_rows(self.drafter.block(x, positions, ctx, length=length))[:rows]
        return ph, self.draft_head(ph)

    def scorer(self, arm: str, rnd: Round, k: int, topm: int):
        if arm == "marg":
            return MarginalScorer(rnd, k)
        cls = {"dominotree": DominoScorer, "condstatic": CondStaticScorer}[arm]
        return cls(
            rnd, self.drafter.head, self.target.model.embed_tokens, k, topm, self.drafter.cfg.pure_draft_prefix_len
        )

    def domino_chain(self, rnd: Round) -> torch.Tensor:
        head, embed = self.drafter.head, self.target.model.embed_tokens
        return domino_chain(rnd, head, embed, self.drafter.cfg.pure_draft_prefix_len)[0]

    def frontier(self, rnd: Round, budget: int, arm: str, k: int, topm: int, max_depth: int) -> FrontierTrees:
        return build_frontier(self.scorer(arm, rnd, k, topm), budget, max_depth, self.drafter.cfg.mask_token_id)

    # cost probes: they write only past the committed entries, which the next forward overwrites
    def time_verify(self, n: int, past: int):
        saved = self.cache.past
        self.cache.past = past
        try:
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            self.target_forward(torch.zeros(n, dtype=torch.long), torch.arange(past, past + n), mask)
            self.synchronize()
        finally:
            self.cache.past = saved

    # the prefix cache (dtrt.runtime.prefix_cache): the target's K/V [layers, kv_heads, n, head_dim], the drafter's
    def snapshot_refusal(self):
        if type(self.target) is not Target:
            return "a hybrid (Gated-DeltaNet) target's recurrent state is not snapshotted at a prefix's end"
        return None

    def snapshot(self, n: int) -> tuple:
        out = (self.cache.k[..., :n, :].clone(), self.cache.v[..., :n, :].clone())
        if self.draft_cache is not None:
            out += (self.draft_cache.k[:, :, :n].clone(), self.draft_cache.v[:, :, :n].clone())
        return out

    def restore(self, saved: tuple, n: int):
        self.cache.k[..., :n, :] = saved[0][..., :n, :]
        self.cache.v[..., :n, :] = saved[1][..., :n, :]
        self.cache.past = n
        if isinstance(self.cache, StaticKVCache):  # --static-shapes: its rounds read the length on the device
            self.cache.length.fill_(n)
        if self.draft_cache is not None:
            self.draft_cache.k[:, :, :n] = saved[2][:, :, :n]
            self.draft_cache.v[:, :, :n] = saved[3][:, :, :n]
            self.draft_cache.length = n

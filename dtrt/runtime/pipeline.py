"""Everything one generation needs: a backend over a target (+ drafter), a method, the tokenizer and its stop ids;
and open_pipeline, the one function that turns a RunSpec and its opened sources into a pipeline."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtrt.artifacts.engine import Engine
from dtrt.artifacts.export import Export
from dtrt.artifacts.files import sha256
from dtrt.errors import DtrtError
from dtrt.models.checkpoint import Pair, check_pair, load_drafter, load_target, parse_dtype
from dtrt.models.config import generation_eos, read_json
from dtrt.models.draft_vocab import check_vocab_size, load_draft_vocab, resolve_draft_vocab
from dtrt.models.quant import dequantized, quant_spec
from dtrt.models.tokenizer import load_tokenizer
from dtrt.runtime.backends.base import Backend
from dtrt.runtime.generate import Generation, Step, capacity_for, collect, generate
from dtrt.runtime.methods import Method, make_method
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec


@dataclass(frozen=True)
class Sources:
    """What a spec runs from, opened and checked by the front end (dtrt.launch): the runtime reads these and never
    writes an artifact."""

    pair: Pair | None = None
    """Checkpoints: what the torch backend runs; for an export backend, what the export must come from."""
    export: Export | None = None
    """onnxruntime: the export it runs; tensorrt: the export the engines were built from."""
    engine: Engine | None = None
    """tensorrt: the engine directory."""


@dataclass
class Pipeline:
    backend: Backend
    method: Method
    spec: RunSpec
    tokenizer: object
    eos: tuple[int, ...]

    def prompt_room(self, max_new_tokens: int) -> int | None:
        """The most prompt tokens that fit with `max_new_tokens` into the backend's context (None: no limit)."""
        limit = self.backend.max_context
        if limit is None:
            return None
        block = self.backend.drafter.cfg.block_size if self.method.uses_drafter else 1
        return limit - capacity_for(0, max_new_tokens, self.spec.budget, block)

    def check_context(self, prompt_len: int, max_new_tokens: int, flag="--max-new-tokens", truncate="--truncate"):
        """A prompt that does not fit is an error naming the numbers and the ways out (`flag`, `truncate`)."""
        room = self.prompt_room(max_new_tokens)
        if room is None or prompt_len <= room:
            return
        limit = self.backend.max_context
        need = prompt_len + limit - room
        ways = (
            f"shorten the prompt, lower {flag}, or pass {truncate} to keep the prompt's last {room} tokens"
            if room > 0
            else f"lower {flag}"
        )
        if (fix := self.backend.context_fix(need)) is not None:
            ways += f", or raise the limit with `{fix}`"
        raise DtrtError(
            f"the prompt ({prompt_len} tokens) + {flag} {max_new_tokens} + one tree need {need} "
            f"positions, but {self.backend.context_source} is {limit}; {ways}"
        )

    def stream(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, logprobs: int | None = None
    ) -> Iterator[Step]:
        """The generation as a stream of rounds (dtrt.runtime.generate); `logprobs` k: each round's tokens carry
        the target's log-probabilities and top k alternatives."""
        if not prompt_ids:
            raise DtrtError("the prompt is empty: give some text")
        self.check_context(len(prompt_ids), max_new_tokens)
        return generate(
            self.backend, self.method, prompt_ids, max_new_tokens, sampling, self.eos, self.spec.budget, logprobs
        )

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig) -> Generation:
        return collect(self.stream(prompt_ids, max_new_tokens, sampling))


def stop_ids(config_eos, tokenizer, folder: Path) -> tuple[int, ...]:
    """Every id that ends a generation: the target config's EOS ids, those of `folder`/generation_config.json (the
    checkpoint directory, or an export's tokenizer/) and the tokenizer's."""
    eos = set(config_eos) | set(generation_eos(folder))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


def tokenizer_dir(spec: RunSpec, sources: Sources) -> Path:
    """Where the spec's tokenizer is read from: the target checkpoint (torch), else the export's tokenizer/."""
    return Path(sources.pair.target) if spec.backend == "torch" else sources.export.path / "tokenizer"


def open_pipeline(spec: RunSpec, sources: Sources) -> Pipeline:
    """The pipeline `spec` describes over `sources` (see dtrt.launch.open_sources)."""
    method = make_method(spec)
    if spec.backend == "torch":
        backend, tokenizer, eos = _torch_backend(spec, sources.pair)
    else:
        exp = sources.export
        if spec.dtype is not None and spec.dtype != exp.dtype:
            raise DtrtError(
                f"--dtype {spec.dtype}: {exp.path} holds {exp.dtype} graphs; drop --dtype or re-export with "
                f"`{exp.fix_hint(dtype=spec.dtype)}`"
            )
        if spec.quant is not None and spec.quant != exp.quant_name:
            raise DtrtError(
                f"--quant {spec.quant}: {exp.path} holds {exp.target_kind}; drop --quant or re-export with "
                f"`{exp.fix_hint(quant=spec.quant)}`"
            )
        order = exp.manifest.get("ordered_attention")
        if order and spec.method_class.has_budget and spec.budget + 1 > order["max_rows"]:
            raise DtrtError(
                f"--budget {spec.budget}: {exp.path} holds {exp.target_kind}, whose verify reproduces its AR "
                f"tokens for trees of at most {order['max_rows']} nodes; use --budget {order['max_rows'] - 1} or less"
            )
        kind = _drafter_kind(spec, exp)
        if kind is not None:
            check_draft_vocab(spec.draft_vocab, exp, kind)
        if spec.backend == "onnxruntime" and exp.dtype == "bf16" and spec.device == "cpu":
            raise DtrtError(
                f"{exp.path} holds bf16 graphs, which ONNX Runtime's CPU provider cannot run (it has no bf16 kernels); "
                f"build TensorRT engines from it (`dtrt build-engine {exp.path} --out ENGINES`, then --engines "
                f"ENGINES), or re-export for the CPU with `{exp.fix_hint(dtype='fp32')}`"
            )
        if spec.backend == "onnxruntime":
            from dtrt.runtime.backends.onnxruntime import OrtBackend

            backend = OrtBackend(exp, kind, spec.threads, spec.device)
        else:
            from dtrt.runtime.backends.tensorrt import TrtBackend

            backend = TrtBackend(sources.engine, exp, kind)
        tokenizer = load_tokenizer(tokenizer_dir(spec, sources))
        eos = stop_ids(exp.manifest["target"]["eos_token_id"], tokenizer, tokenizer_dir(spec, sources))
    backend.prepare(spec)
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    return Pipeline(backend, method, spec, tokenizer, eos)


def _torch_backend(spec: RunSpec, pair: Pair):
    from dtrt.runtime.backends.torch import TorchBackend

    dtype = parse_dtype(spec.dtype or "fp32")
    target = dequantized(load_target(pair.target, dtype), quant_spec(spec.quant or "none"))
    drafter = None
    if spec.uses_drafter:
        path = pair.drafter_for(spec.needs_head)
        if path is None:
            kind = "Domino" if spec.needs_head else "DFlash"
            raise DtrtError(f"--method {spec.method}: no {kind} drafter found for {pair.target}; pass --drafter DIR")
        drafter = load_drafter(path, dtype)
        check_pair(target, drafter, path)
        if spec.needs_head and drafter.head is None:
            raise DtrtError(
                f"{path}: a DFlash checkpoint with no Domino head (prefix_gru.*, embed_proj.*); "
                f"--method {spec.method} needs a Domino drafter (or use dflash, ddtree, caddtree)"
            )
    tokenizer = load_tokenizer(pair.target)
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
    backend = TorchBackend(target, drafter, spec.device, limit, f"max_position_embeddings in {config}", vocab)
    return backend, tokenizer, stop_ids(target.cfg.eos_token_id, tokenizer, pair.target)


def check_draft_vocab(choice: str | None, exp: Export, kind: str):
    """An export's block stage covers the draft vocabulary it was exported with: `--draft-vocab` may only name it."""
    if choice in (None, "auto"):
        return
    have = exp.draft_vocab(kind)
    if choice == "full":
        if have is not None:
            raise DtrtError(
                f"--draft-vocab full: {exp.path} drafts from a {have.size}-token subset; drop --draft-vocab or "
                f"re-export with `{exp.fix_hint(draft_vocab='full')}`"
            )
        return
    want = load_draft_vocab(choice, exp.manifest["target"]["vocab_size"])
    if have is None or have.sha256 != want.sha256:
        what = "the whole vocabulary" if have is None else f"another subset ({have.size} tokens)"
        raise DtrtError(
            f"--draft-vocab {choice}: {exp.path} drafts from {what}; drop --draft-vocab or re-export with "
            f"`{exp.fix_hint(draft_vocab=choice)}`"
        )


def _drafter_kind(spec: RunSpec, exp: Export) -> str | None:
    """The export's drafter that serves the method: Domino's for the corrected scores, else DFlash's (or Domino's
    body)."""
    if not spec.uses_drafter:
        return None
    have = exp.drafters
    if spec.needs_head:
        kind = "domino" if "gru_dim" in have.get("domino", {}) else None
    else:
        kind = next((k for k in ("dflash", "domino") if k in have), None)
    if kind is None:
        need = "Domino" if spec.needs_head else "DFlash"
        raise DtrtError(
            f"--method {spec.method}: {exp.path} holds no {need} drafter; re-export with `{exp.fix_hint()}` from a "
            "pair that has one"
        )
    return kind

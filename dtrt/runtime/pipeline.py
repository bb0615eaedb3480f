"""Everything one generation needs: a backend over a target (+ drafter), a method, the tokenizer and its stop ids;
and open_pipeline, the one function that turns a RunSpec and its opened sources into a pipeline."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtrt.artifacts.engine import Engine
from dtrt.artifacts.export import Export
from dtrt.errors import DtrtError
from dtrt.models.config import generation_eos
from dtrt.models.pair import Pair
from dtrt.runtime.backends.base import Backend
from dtrt.runtime.generate import Generation, Step, capacity_for, collect, generate
from dtrt.runtime.grammar import Grammar
from dtrt.runtime.methods import Method, make_method
from dtrt.runtime.prefix_cache import DEFAULT_MB, PrefixCache, remember
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec
from dtrt.runtime.tokenizer import open_tokenizer


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
    prefix_cache: PrefixCache | None = None

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
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> Iterator[Step]:
        """The generation as a stream of rounds (dtrt.runtime.generate); `logprobs` k: each round's tokens carry
        the target's log-probabilities and top k alternatives; `grammar`: the output follows it (structured
        output, dtrt.runtime.grammar)."""
        if not prompt_ids:
            raise DtrtError("the prompt is empty: give some text")
        self.check_context(len(prompt_ids), max_new_tokens)
        return generate(
            self.backend,
            self.method,
            prompt_ids,
            max_new_tokens,
            sampling,
            self.eos,
            self.spec.budget,
            logprobs,
            grammar,
            self.prefix_cache,
        )

    def remember(self, tokens: list[int], stop_early=None):
        """Keep `tokens` (a request's prompt and what it generated) in the prefix cache, prefilling the positions it
        lacks: the next turn of the conversation restores them. Run where the pipeline would otherwise be idle;
        `stop_early()` turning true (a request came in) ends the prefill at its next boundary, keeping what it did.
        An answer cut short (by its token limit, a stop string) is kept closed by the stop id a chat template closes
        a message with: the next turn's prompt holds it so, and restores the answer whole (a prompt that goes on
        otherwise restores up to the boundary before)."""
        if self.eos and tokens and tokens[-1] not in self.eos:
            eos_id = self.tokenizer.eos_token_id
            tokens = [*tokens, eos_id if eos_id in self.eos else self.eos[0]]
        limit = self.backend.max_context
        if self.prefix_cache is not None and (limit is None or len(tokens) <= limit):
            drafts, lookup = self.method.uses_drafter, self.method.uses_lookup
            remember(self.backend, self.prefix_cache, tokens, drafts, self.eos, lookup, stop_early)

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
    """The pipeline `spec` describes over `sources` (see dtrt.launch.open_sources): the backend --backend names,
    opened and checked by its own class, with the method, the tokenizer and its stop ids."""
    method = make_method(spec)
    backend = backend_class(spec.backend).open(spec, sources)
    folder = tokenizer_dir(spec, sources)
    tokenizer = open_tokenizer(folder)
    if spec.backend == "torch":
        config_eos = backend.target.cfg.eos_token_id
    else:
        config_eos = sources.export.manifest["target"]["eos_token_id"]
    backend.prepare(spec)
    host_threads(spec)
    eos = stop_ids(config_eos, tokenizer, folder)
    return Pipeline(backend, method, spec, tokenizer, eos, prefix_cache(spec, backend))


_torch_threads: int | None = None  # torch's intra-op threads before host_threads first set them


def host_threads(spec: RunSpec):
    """torch's intra-op threads: --threads on the torch backend, whose models they run (without it, as many as torch
    had before a pipeline of this process first set them). Elsewhere torch runs only the host's small ops (the tree,
    the accept walk, the draws) and gets one thread: at two, its idle OpenMP thread spins after each op on the core
    ONNX Runtime's second thread needs (the default 2-thread AR step on a 2-core machine took 12.7 ms against
    10.8 ms)."""
    import torch

    global _torch_threads
    if _torch_threads is None:
        _torch_threads = torch.get_num_threads()
    if spec.backend != "torch":
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(spec.threads or _torch_threads)


def prefix_cache(spec: RunSpec, backend: Backend) -> PrefixCache | None:
    """The spec's prefix cache: on by default where the backend can snapshot its state, silently off where it
    cannot unless --prefix-cache-mb asked for it (one line)."""
    if spec.prefix_cache_mb == 0:
        return None
    refusal = backend.snapshot_refusal()
    if refusal is None:
        return PrefixCache(spec.prefix_cache_mb or DEFAULT_MB)
    if spec.prefix_cache_mb is not None:
        raise DtrtError(f"--prefix-cache-mb {spec.prefix_cache_mb}: {refusal}; drop it (or pass --no-prefix-cache)")
    return None


def backend_class(name: str) -> type[Backend]:
    """The class of a --backend, imported only when asked for (TensorRT, ONNX Runtime and their kernels)."""
    if name == "torch":
        from dtrt.runtime.backends.torch import TorchBackend

        return TorchBackend
    if name == "onnxruntime":
        from dtrt.runtime.backends.onnxruntime import OrtBackend

        return OrtBackend
    from dtrt.runtime.backends.tensorrt import TrtBackend

    return TrtBackend

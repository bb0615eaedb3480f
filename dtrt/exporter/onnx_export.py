"""torch -> ONNX for one stage: dynamo export with named dynamic dims, dtrt nodes with model-local functions."""

import contextlib
import inspect
import io
import logging
import warnings
from pathlib import Path

import onnx
import torch

from dtrt.exporter.graph_passes import slice_past
from dtrt.exporter.stage_modules import Stage
from dtrt.ops import DOMAIN, onnx_functions

OPSET = 20
for _name in ("torch.onnx", "onnxscript"):
    logging.getLogger(_name).setLevel(logging.ERROR)

SKIPPED_RULES = ("SlicesSplit",)
"""onnxscript's default rewrite rules the export leaves out: rules that never fire on dtrt's stages, whose graphs are
the same bytes with them (tests/test_export.py counts their tries and rewrites). SlicesSplit wants two Slices that
halve a static last dim, and rotate_half's second half ends at INT64_MAX; its two-output pattern took 4.4 of the
25.3 s SmolLM2's target stage took to export."""


@contextlib.contextmanager
def default_rules_without(names: tuple[str, ...]):
    """onnxscript's default rewrite rules, which torch.onnx.export's optimize step runs, without those named."""
    try:
        from onnxscript import rewriter
    except ImportError:
        yield
        return
    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None or not names:  # another onnxscript: its rules as they are
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in names)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


_REGISTRIES: dict = {}


@contextlib.contextmanager
def one_torchlib_registry():
    """torch.onnx.export builds its registry of torchlib's ONNX functions anew on every call (about 0.4 s on 2
    cores); dtrt's export only reads it (it passes no custom_translation_table, the one thing that adds to it), so a
    process builds it once for each set of arguments and every stage's export reads that one."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    registry = getattr(_registration, "ONNXRegistry", None)
    build = vars(registry).get("from_torchlib") if registry is not None else None
    if not isinstance(build, classmethod):  # another torch: its registry as it builds it
        yield
        return

    def once(cls, *args, **kwargs):
        key = (cls, args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build.__func__(cls, *args, **kwargs)
        return _REGISTRIES[key]

    registry.from_torchlib = classmethod(once)
    try:
        yield
    finally:
        registry.from_torchlib = build


def export_stage(stage: Stage, path: Path, max_tokens: int, max_context: int, max_batch: int = 64) -> list[Path]:
    """Write `path` (+ `path.data` for the weights); return the files written."""
    dims = {
        "N": torch.export.Dim("N", min=1, max=max_tokens),
        "P": torch.export.Dim("P", min=0, max=max_context),
        "C": torch.export.Dim("C", min=1, max=max_context + max_tokens),
        "bs": torch.export.Dim("bs", min=1, max=max_batch),
        "R": torch.export.Dim("R", min=1, max=max_tokens),  # drafter rows, at most k_draft
    }
    example = stage.example(3, 5, torch.Generator().manual_seed(0))
    args = tuple(example[name] for name in stage.inputs)
    shapes = tuple({axis: dims[d] for axis, d in stage.dynamic.get(name, {}).items()} or None for name in stage.inputs)
    params = inspect.signature(stage.module.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):  # torch.export wants the *args' shapes as one tuple
        fixed = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
        shapes = (*shapes[:fixed], tuple(shapes[fixed:]))
    with (
        torch.no_grad(),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
        default_rules_without(SKIPPED_RULES),
        one_torchlib_registry(),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            stage.module.eval(),
            args,
            input_names=stage.inputs,
            output_names=stage.outputs,
            dynamic_shapes=shapes,
            dynamo=True,
            opset_version=OPSET,
            verbose=False,
        )
    # the weights stream from the program's tensors (views of the module's) into the data file: serializing the
    # whole model to one protobuf first would hold another copy of every weight
    data = path.with_suffix(".onnx.data")
    program.save(str(path), external_data=True)
    model = onnx.load(str(path), load_external_data=False)
    slice_past(model)
    drop_stack_traces(model)
    name_output_dims(model, stage.output_dims)
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    model.functions.extend(onnx_functions(used))
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    return [path, data] if data.exists() else [path]


STACK_TRACE = "pkg.torch.onnx.stack_trace"
"""The node metadata torch.onnx writes with each node's Python stack: the absolute paths of the installed dtrt and
torch and their line numbers, a quarter to a third of a graph file's bytes (356 KB of SmolLM2's 1.17 MB target
graph)."""


def drop_stack_traces(model: onnx.ModelProto) -> int:
    """Drop STACK_TRACE from every node, in place (subgraphs and functions too); return how many. So a stage is the
    same bytes wherever dtrt is installed and whatever lines its source moved to, and names no path of the machine
    that exported it; the node's module path (`namespace`) and FX node stay."""
    dropped = 0

    def visit(nodes):
        nonlocal dropped
        for node in nodes:
            keep = [p for p in node.metadata_props if p.key != STACK_TRACE]
            if len(keep) != len(node.metadata_props):
                dropped += len(node.metadata_props) - len(keep)
                del node.metadata_props[:]
                node.metadata_props.extend(keep)
            for attr in node.attribute:
                for graph in (attr.g, *attr.graphs) if attr.HasField("g") else attr.graphs:
                    visit(graph.node)

    visit(model.graph.node)
    for fn in model.functions:
        visit(fn.node)
    return dropped


def name_output_dims(model: onnx.ModelProto, dims: dict[str, dict[int, str]]):
    """Name the outputs' dims that an input's value sets (see Stage.output_dims)."""
    for out in model.graph.output:
        for axis, name in dims.get(out.name, {}).items():
            out.type.tensor_type.shape.dim[axis].dim_param = name

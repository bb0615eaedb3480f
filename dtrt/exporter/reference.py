"""The PyTorch truth of an export, as a stage runner: every stage of its manifest rebuilt from the checkpoints it
was exported from, run through the same `runner(stage, **feeds)` contract as ONNX Runtime and TensorRT
(dtrt.runtime.backends.exported.StageRunner), so that parity compares runner with runner."""

from pathlib import Path

import torch

from dtrt.artifacts.export import Export, check_source
from dtrt.artifacts.files import MANIFEST
from dtrt.errors import DtrtError
from dtrt.exporter.stage_modules import Stage
from dtrt.exporter.write import load_models, pair_stages
from dtrt.models.checkpoint import parse_dtype
from dtrt.models.quant import dequantized
from dtrt.runtime.backends.exported import StageRunner


def reference_stages(exp: Export) -> dict[str, Stage]:
    """The torch wrappers of every stage in the export's manifest, built from the checkpoints it was exported
    from (checked by hash) in the export's dtype, in manifest order."""
    m, src = exp.manifest, exp.manifest["source"]
    drafter_paths = {kind: Path(d["path"]) for kind, d in src["drafters"].items()}
    check_source(exp, Path(src["target"]), drafters=drafter_paths)
    target, drafters, taps = load_models(Path(src["target"]), drafter_paths, parse_dtype(m["dtype"]))
    models = {k: d for k, (_, d) in drafters.items()}
    vocabs = {k: exp.draft_vocab(k) for k in models}
    built = {s.name: s for s in pair_stages(target, taps, models, m["budget"], m["topm"], m["node_topk"], vocabs)}
    if exp.quant is not None:  # the quantized model: the same dequantized weights; the drafters keep the others
        built["target"].module.target = dequantized(target, exp.quant)
    out = {}
    for name, meta in m["stages"].items():
        if name not in built:
            raise DtrtError(
                f"{exp.path / MANIFEST}: this dtrt has no PyTorch reference for stage {name!r}; "
                f"re-export with `{exp.fix_hint()}`"
            )
        s = built[name]
        if (s.inputs, s.outputs) != (meta["inputs"], meta["outputs"]):
            raise DtrtError(
                f"{exp.path / MANIFEST}: stage {name!r} records inputs {meta['inputs']} and outputs "
                f"{meta['outputs']}, this dtrt builds {s.inputs} -> {s.outputs}; "
                f"re-export with `{exp.fix_hint()}`"
            )
        out[name] = s
    return out


class TorchStageRunner(StageRunner):
    """The export's stages as their PyTorch modules, on the CPU. `stages` replaces the references rebuilt from the
    checkpoints (a test perturbs one to see parity fail); otherwise they are rebuilt on first use."""

    name = "torch"

    def __init__(self, export: Export, stages: dict[str, Stage] | None = None):
        self.export, self.device = export, torch.device("cpu")
        self._stages = stages
        self.types: dict[str, dict[str, torch.dtype]] = {}

    @property
    def stages(self) -> dict[str, Stage]:
        if self._stages is None:
            self._stages = reference_stages(self.export)
        return self._stages

    def has(self, stage: str) -> bool:
        return stage in self.stages

    def stage(self, name: str) -> Stage:
        return self.stages[name]

    def open(self, stage: str):
        if stage in self.types:
            return
        if stage not in self.stages:
            raise DtrtError(f"{self.export.path / MANIFEST}: no PyTorch reference for stage {stage!r} here")
        s = self.stages[stage]
        s.module.eval()
        # the graph was traced from these examples: its inputs take their dtypes
        example = s.example(1, 0, torch.Generator().manual_seed(0))
        self.types[stage] = {n: example[n].dtype for n in s.inputs}

    def inputs(self, stage: str) -> dict[str, torch.dtype]:
        return self.types[stage]

    def run(self, stage: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self.stages[stage]
        with torch.no_grad():
            outs = s.module(*(feeds[n] for n in s.inputs))
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        return {n: t.detach() for n, t in zip(s.outputs, outs)}

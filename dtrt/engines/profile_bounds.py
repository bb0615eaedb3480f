"""Optimization profiles: for every stage, (min, opt, max) of each input shape, from the export's graphs.

The dynamic dims of an export are named (dtrt.exporter.onnx_export): N new tokens or tree nodes, P past
positions, C the target's cache capacity (its K/V buffer, of which the past is the first P positions), bs
requests, R the drafter rows a round asks for (1..k_draft: the block's `rows` input sets it, a shape tensor to
TensorRT, whose values a profile bounds too). A decode profile covers what a round needs (N up to the largest
tree, P and C up to the context); the stages that also read a prompt (the target, the drafters' context) get a
second, prefill profile with N up to the whole context. The runtime picks the first profile that holds the shapes
of a call.
"""

from dataclasses import dataclass
from pathlib import Path

from dtrt.artifacts.profiles import VALUE_DIMS, Profile
from dtrt.errors import DtrtError

PREFILL_OPT = 256  # prompt length the prefill profile is tuned for


@dataclass(frozen=True)
class Limits:
    budget: int  # draft nodes of the tree methods
    k_draft: int  # the largest drafter depth (chain methods verify k_draft + 1 tokens)
    node_topk: int  # children per node (the heap advances k states at once)
    max_context: int  # largest past + new tokens
    max_batch: int  # requests of the batched stages (the frontier)

    @classmethod
    def of_export(cls, manifest: dict, max_batch: int) -> "Limits":
        k_draft = max((d.get("k_draft", 0) for d in manifest.get("drafters", {}).values()), default=0)
        return cls(manifest["budget"], k_draft, manifest["node_topk"], manifest["max_context"], max_batch)

    @property
    def tree(self) -> int:
        """The most tokens one verify (or one context append) carries: the root and the largest tree."""
        return max(self.budget, self.k_draft) + 1


def reads_prompt(stage: str) -> bool:
    return stage == "target" or stage.endswith(".context")


def dim_ranges(stage: str, limits: Limits) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Profile name -> dim name -> (min, opt, max)."""
    kind = stage.rsplit(".", 1)[-1]
    n_max = max(limits.tree, limits.node_topk) if kind.startswith("scorer") else limits.tree
    n_opt = {"scorer_children": 1, "scorer_advance": limits.node_topk}.get(kind, limits.budget + 1)
    ctx = limits.max_context
    rows = max(1, limits.k_draft)
    decode = {
        "N": (1, min(n_opt, n_max), n_max),
        "P": (0, ctx // 2, ctx),
        "C": (1, ctx // 2, ctx),
        "bs": (1, 1, limits.max_batch),
        "R": (1, min(limits.budget, rows), rows),
    }
    ranges = {"decode": decode}
    if reads_prompt(stage):
        ranges["prefill"] = {"N": (1, min(PREFILL_OPT, ctx), ctx), "P": (0, 0, ctx), "C": (1, ctx // 2, ctx)}
    return ranges


def stage_profiles(stage: str, inputs: dict[str, dict], limits: Limits) -> list[Profile]:
    """inputs: name -> {"dims": [int | dim name], ...} as in the ONNX graph."""
    profiles = []
    for name, dims in dim_ranges(stage, limits).items():
        shapes, values = {}, {}
        for inp, meta in inputs.items():
            if inp in VALUE_DIMS:
                values[inp] = tuple((r,) for r in dims[VALUE_DIMS[inp]])
            rng = []
            for d in meta["dims"]:
                if isinstance(d, int):
                    rng.append((d, d, d))
                elif d in dims:
                    rng.append(dims[d])
                else:
                    raise DtrtError(
                        f"stage {stage}: input {inp} has a dynamic dim {d!r} that no profile covers "
                        f"(known: N, P, C, bs, R); re-export it with this dtrt's `dtrt export`"
                    )
            shapes[inp] = tuple(tuple(r[i] for r in rng) for i in range(3))
        profile = Profile(name, shapes, values)
        if not profiles or (profile.shapes, profile.values) != (profiles[0].shapes, profiles[0].values):
            profiles.append(profile)
    return profiles


def onnx_signature(path: Path) -> tuple[dict, dict]:
    """(inputs, outputs) of an ONNX graph, name -> {"dims": [int | dim name], "dtype": ONNX type name},
    read without its external weights."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph

    def describe(values) -> dict:
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out[v.name] = {"dims": dims, "dtype": onnx.TensorProto.DataType.Name(t.elem_type)}
        return out

    return describe(graph.input), describe(graph.output)

"""The method registry: each method class declares its traits once, and the spec, the launch layer, the export
backends and the bench ask it (dtrt.runtime.methods)."""

import click
import pytest

from dtrt.bench import contenders
from dtrt.cli import cli
from dtrt.errors import DtrtError
from dtrt.launch import resolve_spec
from dtrt.runtime.methods import METHODS, method_class
from dtrt.runtime.spec import METHODS as CHOICES
from dtrt.runtime.spec import RunSpec
from dtrt.zoo.registry import default_budget, lookup_help

# name: (uses_drafter, has_budget, cost_aware, builders, takes_lookup, cuda_graph)
TRAITS = {
    "ar": (False, False, False, (), False, False),
    "lookup": (False, True, False, (), False, False),
    "dflash": (True, False, False, (), False, False),
    "domino": (True, False, False, (), False, False),
    "ddtree": (True, True, False, (), False, False),
    "caddtree": (True, True, True, (), False, False),
    "dominotree": (True, True, False, ("heap", "frontier"), True, True),
    "cadominotree": (True, True, True, ("heap",), True, False),
}


def test_every_method_declares_its_traits():
    assert tuple(METHODS) == tuple(TRAITS) == CHOICES
    for name, cls in METHODS.items():
        assert cls.name == name
        got = (cls.uses_drafter, cls.has_budget, cls.cost_aware, cls.builders, cls.takes_lookup, cls.cuda_graph)
        assert got == TRAITS[name], name


def test_the_cli_offers_the_registry():
    ctx = click.Context(cli)
    for command in ("run", "parity", "serve"):
        opt = {p.name: p for p in cli.get_command(ctx, command).params}.get("method")
        if opt is not None:
            assert tuple(opt.type.choices) == tuple(METHODS), command


@pytest.mark.parametrize(
    ("kw", "head", "stages"),
    [
        ({"method": "ar"}, False, ()),
        ({"method": "lookup"}, False, ()),
        ({"method": "dflash"}, False, ()),
        ({"method": "ddtree"}, False, ()),
        ({"method": "domino"}, True, ("chain",)),
        ({"method": "dominotree"}, True, ("scorer",)),
        ({"method": "dominotree", "arm": "condstatic"}, True, ("scorer",)),
        ({"method": "dominotree", "arm": "marg"}, False, ()),
        ({"method": "dominotree", "builder": "frontier"}, True, ("scorer", "frontier")),
        ({"method": "dominotree", "builder": "frontier", "arm": "condstatic"}, True, ("scorer",)),
        ({"method": "dominotree", "builder": "frontier", "arm": "marg"}, False, ()),
        ({"method": "cadominotree"}, True, ("scorer",)),
    ],
)
def test_head_and_drafter_stages_per_spec(kw, head, stages):
    spec = RunSpec(**kw)
    assert spec.needs_head is head and spec.uses_drafter is METHODS[spec.method].uses_drafter
    assert spec.method_class.drafter_stages(spec) == stages


def test_the_traits_decide_the_spec_the_defaults_and_the_bench():
    # a budget in the label only where the budget sizes the trees
    assert RunSpec(method="ddtree", budget=4).label == "ddtree@4" and RunSpec(method="dflash").label == "dflash"
    # --lookup only on the methods that take it; a builder the method does not grow with is refused
    with pytest.raises(DtrtError, match="--method dominotree or cadominotree"):
        RunSpec(method="ddtree", lookup=True)
    with pytest.raises(DtrtError, match="use --builder heap"):
        RunSpec(method="cadominotree", builder="frontier")
    with pytest.raises(DtrtError, match="--cuda-graph"):
        RunSpec(method="cadominotree", cuda_graph=True, device="cuda")
    # the cost-aware methods' budget is the cap; the others the model's
    assert default_budget("smollm2-135m", "int8", "cadominotree") == 16
    assert default_budget("smollm2-135m", "int8", "dominotree") == 1
    # prompt lookup's chains: budget 4 on the fp32 target, 2 on the quantized ones; DominoTree alone 1 on int8/int4
    for quant, budget in (("none", 4), ("int8", 2), ("int4", 2), ("gguf", 2)):
        spec = resolve_spec(model="smollm2-135m", backend="onnxruntime", quant=quant)
        assert (spec.method, spec.lookup, spec.budget) == ("dominotree", True, budget), quant
        assert default_budget("smollm2-135m", quant, "dominotree", lookup=True) == budget
    assert resolve_spec(model="smollm2-135m", backend="onnxruntime", quant="int4", lookup=False).budget == 1
    assert "(budgets fp32 4, int8 2, int4 2, gguf 2, gguf-a8 2)" in lookup_help()
    # cuda devices pick the frontier for the methods that grow with it, the heap for the others
    assert resolve_spec(model="tiny", method="cadominotree", device="cpu").builder == "heap"
    # the bench sweeps budgets of the budget methods only, and names lookup rows from the takers
    grid = contenders.grid({"model": "tiny", "threads": 1}, ["dflash", "ddtree"], [2, 3], [None])
    assert contenders.labels(grid) == ["ar", "dflash", "ddtree@2", "ddtree@3"]
    assert set(contenders.ROW_METHODS) - set(METHODS) == {"dominotree+lookup", "cadominotree+lookup"}


def test_an_unknown_method_is_one_line():
    with pytest.raises(DtrtError, match=r"^--method 'beam': use one of ar, lookup, dflash"):
        method_class("beam")

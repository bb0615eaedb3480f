"""An export run alone (`dtrt run --export DIR`, `dtrt serve --export DIR`, `dtrt bench --export DIR`; engines, the
export they were built from) takes the defaults of the registry model its manifest says it was exported from, for
its target's quantization, and a method it holds the drafter for: ddtree over a DFlash drafter alone, prompt lookup
where it holds none (a user's own GGUF file exported without a drafter runs, and gives AR's tokens with lookup's
drafts accepted). A model without an entry runs on a CPU at zoo.registry.CPU_BUDGET with lookup's chains in its
trees (TensorRT, on a GPU: 16 without them); a method the export cannot serve, asked for by name, says in one line
what runs and how to export with a drafter."""

import json

import pytest
from helpers import run_cli
from test_ort_backend import broken, edit_manifest  # noqa: F401 (broken: the fixture)

from dtrt.errors import DtrtError
from dtrt.launch import resolve_spec
from dtrt.zoo.registry import CPU_BUDGET, MODELS

GGUF_QUANT = {"format": "gguf", "activations": "fp32", "weights": 4, "products": 4}


@pytest.fixture
def export(broken):  # noqa: F811
    """A copy of the tiny export whose manifest the test edits."""
    return broken


def defaults(**flags):
    s = resolve_spec(**flags)
    return s.method, s.budget, s.lookup


def test_an_export_of_a_registry_model_takes_its_defaults(export):
    """The embedded default's own export, run alone, is run as `dtrt run` runs it: its registry budget and lookup's
    chains on its quantization, not an unknown model's defaults."""

    def from_smollm2(m):
        m["source"]["model"] = "smollm2-135m"
        m["quant"] = GGUF_QUANT

    edit_manifest(export, from_smollm2)
    entry = MODELS["smollm2-135m"]
    want = (entry.method_for("gguf"), entry.budget_for("gguf", lookup=True), True)
    assert defaults(export=str(export)) == want == defaults(model="smollm2-135m", quant="gguf")[:2] + (True,)
    assert defaults(model="smollm2-135m", export=str(export)) == want  # named with it: its target's quantization
    # what is given stays given
    assert defaults(export=str(export), budget=7, lookup=False) == (want[0], 7, False)
    assert defaults(export=str(export), method="ddtree")[0] == "ddtree"


def test_an_export_of_a_model_without_an_entry_runs_cautious_trees_on_a_cpu(export):
    edit_manifest(export, lambda m: m["source"].update(model=None))
    assert defaults(export=str(export)) == ("dominotree", CPU_BUDGET, True)
    assert defaults(export=str(export), builder="frontier")[1:] == (CPU_BUDGET, False)  # lookup needs the heap
    assert defaults(export=str(export), method="cadominotree")[1] == 16  # a cap, not a budget
    # the registry's own entries keep theirs
    assert defaults(model="tiny") == ("dominotree", 16, False)


@pytest.mark.parametrize(
    ("drafters", "method"),
    [
        (lambda d: d.pop("domino"), "ddtree"),  # a DFlash drafter alone
        (lambda d: (d.pop("dflash"), d["domino"].pop("gru_dim")), "ddtree"),  # a Domino drafter without its head
        (lambda d: d.clear(), "lookup"),  # none: a user's GGUF file exported alone
    ],
    ids=["dflash-only", "no-head", "no-drafter"],
)
def test_the_default_method_is_one_the_export_holds_the_drafter_for(export, drafters, method):
    edit_manifest(export, lambda m: drafters(m["drafters"]))
    assert defaults(export=str(export))[0] == method
    assert defaults(export=str(export), method="ar")[0] == "ar"


def test_a_drafterless_export_runs_lookup_by_default_with_ar_tokens(export):
    from dtrt.launch import pipeline
    from dtrt.runtime.sampling import SamplingConfig

    edit_manifest(export, lambda m: m["drafters"].clear())
    spec = resolve_spec(export=str(export))
    assert spec.method == "lookup"
    prompt = [3, 17, 42, 5, 9, 60, 11, 2, 3, 17, 42, 5, 9, 60, 11, 2, 3, 17]
    gen = pipeline(spec).generate(prompt, 32, SamplingConfig())
    ar = pipeline(resolve_spec(export=str(export), method="ar")).generate(prompt, 32, SamplingConfig())
    assert gen.tokens == ar.tokens
    assert sum(r.accepted for r in gen.rounds) > len(gen.rounds)  # lookup's drafts accepted


def test_a_method_the_export_cannot_serve_says_what_runs(export, monkeypatch, capsys):
    def no_drafters(m):
        m["drafters"].clear()
        m["source"]["gguf"] = "/models/mine.gguf"

    edit_manifest(export, no_drafters)
    code, _, err = run_cli(monkeypatch, capsys, "run", "--export", str(export), "--method", "dominotree", "hi")
    line = err.strip()
    assert code == 2 and "\n" not in line and "Traceback" not in line
    assert "holds no Domino drafter" in line and "--method lookup or ar" in line
    assert "dtrt export --gguf /models/mine.gguf --drafter DIR" in line


def test_an_unreadable_manifest_is_still_the_loaders_one_line(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    spec = resolve_spec(export=str(tmp_path))  # the defaults of no model: the load says what is wrong
    from dtrt.launch import pipeline

    with pytest.raises(DtrtError, match="not valid JSON"):
        pipeline(spec)


@pytest.mark.parametrize("nested", [False, True], ids=["engine-dir", "out-root"])
def test_engines_take_the_defaults_of_the_export_they_were_built_from(export, tmp_path, nested):
    """`--engines DIR` (an engine directory, or the --out root holding one, machine key and model below it): its
    manifest's export is read for the defaults; its plans and machine are checked only when the engines open."""
    edit_manifest(export, lambda m: (m["drafters"].clear(), m["source"].update(model=None)))
    engines = tmp_path / "engines"
    where = engines / "h100-trt11" / "tiny" if nested else engines
    where.mkdir(parents=True)
    (where / "manifest.json").write_text(json.dumps({"format": "dtrt-engine", "export": {"path": str(export)}}))
    spec = resolve_spec(engines=str(engines))
    assert (spec.backend, spec.method, spec.budget) == ("tensorrt", "lookup", 16)  # a GPU's budget
    (where.parent / "other").mkdir()
    (where.parent / "other" / "manifest.json").write_text("{}")
    if nested:  # two engine directories: which one runs is open_engine's to say, so no export's defaults
        assert resolve_spec(engines=str(engines)).method == "dominotree"

"""Structured output on the tiny pair: JSON valid under its schema (nested objects, enums, arrays, numbers), the
same tokens as AR under the same grammar at T=0 (and with the same seed at T>0) for dominotree, ddtree, dflash and
lookup on torch and ONNX Runtime with drafts accepted (each method's tau above AR's under the grammar, whose forced
tokens already lift AR's above 1), the tree's masks (forbidden nodes dropped, forced tokens added), and the bad
inputs of `dtrt run --json-schema` and of `response_format`."""

import json

import pytest
from helpers import pipe_for, spec

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from dtrt.errors import DtrtError  # noqa: E402
from dtrt.runtime.generate import collect  # noqa: E402
from dtrt.runtime.grammar import compile_format  # noqa: E402
from dtrt.runtime.request_values import ResponseFormat, parse_response_format  # noqa: E402
from dtrt.runtime.sampling import SamplingConfig  # noqa: E402
from dtrt.tree import Tree  # noqa: E402
from dtrt.tree.grammar import fit_tree  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["small", "large"]}},
        "required": ["colour", "size"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
}
PROMPTS = ["The cat sees ", "A quick fox "]
# prompts whose answers copy them: lookup's chains match
COPY = ["man still sad city wind, man still sad city wind, man still sad ", 'man still sad city wind, {"text": "man ']
TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 40}},
    "required": ["text"],
    "additionalProperties": False,
}
PAIR = {
    "type": "object",
    "properties": {"name": NAME, "size": {"enum": ["small", "large"]}},
    "required": ["name", "size"],
    "additionalProperties": False,
}
MAX_NEW = 128
T0 = SamplingConfig()


def run(pipe, prompt, schema, sampling=T0, max_new=MAX_NEW):
    grammar = compile_format(ResponseFormat("json_schema", schema), pipe.tokenizer)
    ids = pipe.tokenizer.encode(prompt, add_special_tokens=False)
    return collect(pipe.stream(ids, max_new, sampling, grammar=grammar))


@pytest.fixture(scope="module")
def ar(tiny):
    return pipe_for(tiny, spec("ar"))


@pytest.mark.parametrize("name", SCHEMAS)
def test_outputs_are_valid_under_their_schema(tiny, name):
    pipe = pipe_for(tiny, spec("dominotree"))
    for prompt in PROMPTS:
        gen = run(pipe, prompt, SCHEMAS[name])
        assert gen.stop_reason == "eos", pipe.tokenizer.decode(gen.tokens)
        jsonschema.validate(json.loads(pipe.tokenizer.decode(gen.tokens, skip_special_tokens=True)), SCHEMAS[name])


def equal_to_ar(pipe, ar_pipe, cases, sampling=T0):
    taus = []
    for prompt, schema in cases:
        want, got = run(ar_pipe, prompt, schema, sampling), run(pipe, prompt, schema, sampling)
        assert got.tokens == want.tokens, (
            prompt,
            pipe.tokenizer.decode(got.tokens),
            ar_pipe.tokenizer.decode(want.tokens),
        )
        taus.append((got.tau, want.tau))
    mean, ar_mean = (sum(t) / len(taus) for t in zip(*taus))
    assert mean > 1 and mean > ar_mean, (mean, ar_mean)  # drafts accepted beyond the grammar's forced tokens


CASES = [(p, s) for p in PROMPTS for s in (SCHEMAS["nested"], SCHEMAS["numbers"], PAIR)]
LOOKUP_CASES = [(p, TEXT) for p in COPY]
METHODS = {"dominotree": CASES, "ddtree": CASES, "dflash": CASES, "lookup": LOOKUP_CASES}


@pytest.mark.parametrize("method", METHODS)
def test_equal_to_ar_under_the_grammar_on_torch(tiny, ar, method):
    equal_to_ar(pipe_for(tiny, spec(method)), ar, METHODS[method])


@pytest.mark.parametrize("method", METHODS)
def test_equal_to_ar_under_the_grammar_on_onnxruntime(tiny_export, method):
    def pipe(m):
        return pipe_for(None, spec(m), backend="onnxruntime", export=tiny_export.path, threads=1)

    equal_to_ar(pipe(method), pipe("ar"), METHODS[method])


def test_same_seed_gives_ar_tokens_at_t1(tiny, ar):
    sampling = SamplingConfig(temperature=1.0, seed=3)
    for prompt, schema in CASES[:3]:
        got, want = run(pipe_for(tiny, spec("dominotree")), prompt, schema, sampling), run(ar, prompt, schema, sampling)
        assert got.tokens == want.tokens
        if got.stop_reason == "eos":
            jsonschema.validate(json.loads(ar.tokenizer.decode(got.tokens, skip_special_tokens=True)), schema)


def test_json_object(tiny):
    pipe = pipe_for(tiny, spec("dominotree"))
    grammar = compile_format(ResponseFormat("json_object"), pipe.tokenizer)
    gen = collect(
        pipe.stream(
            pipe.tokenizer.encode("The cat sees ", add_special_tokens=False), 24, SamplingConfig(), grammar=grammar
        )
    )
    text = pipe.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert text.startswith("{")
    if gen.stop_reason == "eos":
        assert isinstance(json.loads(text), dict)


def test_max_tokens_that_cannot_complete_end_with_length(tiny, ar):
    gen = run(ar, "The cat sees ", SCHEMAS["nested"], max_new=5)
    assert gen.stop_reason == "length" and len(gen.tokens) == 5


class Masks:
    """A grammar over paths as a table: the tokens allowed after each path (anything else: every token)."""

    def __init__(self, table):
        self.table = table

    def allows(self, path, token):
        return token in self.table.get(path, {token})

    def forced(self, path):
        allowed = self.table.get(path)
        return next(iter(allowed)) if allowed is not None and len(allowed) == 1 else None


def test_fit_tree_drops_forbidden_nodes_and_adds_forced_tokens():
    tree = Tree.from_parents([0, 5, 6, 7, 8], [-1, 0, 0, 1, 2])  # root -> 5 -> 7, root -> 6 -> 8
    masks = Masks({(): {5, 9}, (5,): {7}, (5, 7): {3}})
    fitted = fit_tree(tree, masks, room=4)
    # 6 is forbidden at the root (8 goes with it); after 5, 7 is forced, and after 5 7, 3 is
    assert fitted.tokens.tolist() == [0, 5, 7, 3] and fitted.parents.tolist() == [-1, 0, 1, 2]
    assert fit_tree(tree, masks, room=2).tokens.tolist() == [0, 5, 7]  # no room for the forced token


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"type": "xml"}, "response_format.type 'xml': use"),
        ("json", "must be an object with a 'type'"),
        ({"type": "json_schema"}, "response_format.json_schema: required"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema.name: required"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "json_schema.schema: required"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}, "strict 'yes'"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "other": 1}}, "unknown key 'other'"),
        ({"type": "json_object", "json_schema": {}}, "unknown key 'json_schema'"),
    ],
)
def test_bad_response_format(value, fragment):
    with pytest.raises(DtrtError, match=None) as e:
        parse_response_format(value)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ({"type": "strin"}, "is not a valid JSON schema: Invalid type: strin"),
        ({"type": "string", "pattern": "[a-"}, "is not a valid JSON schema"),
        ({"type": "object", "not": {"type": "string"}}, "uses a feature dtrt cannot enforce"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "uses a feature dtrt cannot enforce"),
    ],
)
def test_bad_schema_is_one_line(ar, schema, fragment):
    with pytest.raises(DtrtError) as e:
        compile_format(ResponseFormat("json_schema", schema), ar.tokenizer, "--json-schema")
    assert str(e.value).startswith("--json-schema: the schema ") and fragment in str(e.value)
    assert "\n" not in str(e.value)

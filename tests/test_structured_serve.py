"""Structured output through `dtrt serve` with the official `openai` client (tiny pair with a chat template, one
process): `response_format` json_schema and json_object on /v1/chat/completions and /v1/completions give what
complete() gives under the same grammar, valid under the schema; a bad schema, an unsupported schema feature and a
malformed `response_format` are one OpenAI-style 400 naming `response_format`; max tokens that cannot complete the
grammar end with finish_reason "length" and what was generated. Also `dtrt run --json-schema` and its bad inputs."""

import json

import pytest
from helpers import pipe_for, spec
from test_run_cli import PROMPT, run_cli, run_json, tiny_chat  # noqa: F401 (fixture)
from test_structured_output import PAIR

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
jsonschema = pytest.importorskip("jsonschema")

from dtrt.frontend.requests import Request, encode  # noqa: E402
from dtrt.frontend.text import complete  # noqa: E402
from dtrt.runtime.grammar import ResponseFormat, compile_format  # noqa: E402
from dtrt.runtime.sampling import SamplingConfig  # noqa: E402
from dtrt.serve import BackgroundServer, ServeConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "tiny-chat"
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pair", "schema": PAIR, "strict": True}}


@pytest.fixture(scope="module")
def local_pipe(tiny, tiny_chat):  # noqa: F811
    return pipe_for(tiny_chat, spec("dominotree"))


@pytest.fixture(scope="module")
def url(tiny, tiny_chat):  # noqa: F811
    """The server's own pipeline: its worker fills the prefix cache between requests, so the references here run
    on another pipeline, never on the server's while it works."""
    with BackgroundServer(pipe_for(tiny_chat, spec("dominotree")), ServeConfig(NAME)) as s:
        yield s.url


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def reference(pipe, fmt: ResponseFormat, prompt=None, messages=None, max_tokens=128):
    ids = encode(pipe.tokenizer, Request(prompt, messages), chat=False)
    grammar = compile_format(fmt, pipe.tokenizer)
    return complete(pipe, ids, max_tokens, SamplingConfig(), grammar=grammar)


def test_json_schema_on_chat_and_completions(url, local_pipe):
    c = client(url)
    messages = [{"role": "user", "content": PROMPT}]
    fmt = ResponseFormat("json_schema", PAIR, "pair", True)
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=128, response_format=SCHEMA_FORMAT)
    want = reference(local_pipe, fmt, messages=messages)
    assert chat.choices[0].message.content == want.text and chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), PAIR)
    done = c.completions.create(
        model=NAME, prompt="The cat sees ", max_tokens=128, extra_body={"response_format": SCHEMA_FORMAT}
    )
    want = reference(local_pipe, fmt, prompt="The cat sees ")
    assert done.choices[0].text == want.text
    jsonschema.validate(json.loads(done.choices[0].text), PAIR)


def test_json_object_streamed(url, local_pipe):
    c = client(url)
    messages = [{"role": "user", "content": PROMPT}]
    chunks = c.chat.completions.create(
        model=NAME, messages=messages, max_tokens=24, response_format={"type": "json_object"}, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == reference(local_pipe, ResponseFormat("json_object"), messages=messages, max_tokens=24).text
    assert text.startswith("{")


def test_max_tokens_that_cannot_complete_end_with_length(url):
    done = client(url).completions.create(
        model=NAME, prompt="The cat sees ", max_tokens=4, extra_body={"response_format": SCHEMA_FORMAT}
    )
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "fmt, fragment",
    [
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}, "not a valid JSON schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {"type": "string"}}}},
            "uses a feature dtrt cannot enforce",
        ),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "json_schema.schema: required"),
        ({"type": "yaml"}, "response_format.type 'yaml'"),
    ],
)
def test_bad_response_format_is_an_openai_error(url, fmt, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=fmt
        )
    err = e.value.body
    assert err["param"] == "response_format" and fragment in err["message"] and "\n" not in err["message"], err


def test_run_json_schema(tmp_path, monkeypatch, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(PAIR))
    out = run_json(monkeypatch, capsys, "--json-schema", str(path), "--max-new-tokens", "128", "The cat sees ")
    jsonschema.validate(json.loads(out["text"]), PAIR)
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps(SCHEMA_FORMAT["json_schema"]))
    again = run_json(monkeypatch, capsys, "--json-schema", str(wrapped), "--max-new-tokens", "128", "The cat sees ")
    assert again["text"] == out["text"]


@pytest.mark.parametrize(
    "content, args, fragment",
    [
        ('{"type": "strin"}', (), "--json-schema: the schema is not a valid JSON schema: Invalid type: strin"),
        ('{"not": {"type": "string"}}', (), "--json-schema: the schema uses a feature dtrt cannot enforce"),
        ("{nope", (), "not JSON"),
        ("[1]", (), "a JSON schema is an object, not list"),
        ("{}", ("--json-object",), "--json-schema and --json-object exclude each other"),
    ],
)
def test_run_bad_json_schema(tmp_path, monkeypatch, capsys, content, args, fragment):
    path = tmp_path / "schema.json"
    path.write_text(content)
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--json-schema", str(path), *args, "x")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_run_jsonl_line_with_a_bad_schema_stops_before_any_output(tmp_path, monkeypatch, capsys):
    good = {"prompt": "The cat sees ", "max_tokens": 128, "response_format": SCHEMA_FORMAT}
    unsupported = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {}}}}
    bad = {"prompt": "x", "response_format": unsupported}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--input", str(path))
    assert code == 2 and out == "" and f"{path}:2: response_format: the schema uses a feature" in err, err
    path.write_text(json.dumps(good) + "\n")
    code, out, err = run_cli(monkeypatch, capsys, "run", "--model", "tiny", "--input", str(path))
    assert code == 0, err
    jsonschema.validate(json.loads(json.loads(out)["text"]), PAIR)

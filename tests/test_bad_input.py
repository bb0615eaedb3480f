"""One test per row of the bad-input table (docs/bad-input.md) for `dtrt run` and `dtrt serve`: each bad input is
one line `error: ...` and exit 2 on the command line (no traceback, no output), or a JSON error over HTTP."""

import json
import shutil
import socket
import sys
import urllib.request

import pytest
import torch
from helpers import drafter_json, pipe_for, run_cli, spec, write_drafter
from test_run_cli import PROMPT, tiny_chat, tiny_variant  # noqa: F401 (fixtures)

pytest.importorskip("aiohttp")

from dtrt.serve import BackgroundServer, ServeConfig  # noqa: E402 (needs aiohttp)


def expect_error(monkeypatch, capsys, *args, fragments=()):
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err
    return err


def http(url, body=None, data=None, method=None):
    """(status, JSON body) of one request; an HTTP error status is returned, not raised."""
    data = data if data is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def expect_http_error(url, status, body=None, data=None, param=None, fragments=(), method=None):
    got, reply = http(url, body, data, method)
    assert got == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], reply
    if param is not None:
        assert err["param"] == param, reply
    for f in fragments:
        assert f in err["message"], reply
    return err


# checkpoints and exports


def test_missing_checkpoint(tmp_path, monkeypatch, capsys):
    for cmd, *rest in (("run", "x"), ("serve", "--port", "0")):
        expect_error(
            monkeypatch,
            capsys,
            cmd,
            "--target",
            str(tmp_path / "nope"),
            "--method",
            "ar",
            *rest,
            fragments=(str(tmp_path / "nope"), "not found"),
        )


def test_corrupt_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny.target, target)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--target",
        str(target),
        "--method",
        "ar",
        PROMPT,
        fragments=(str(target / "model.safetensors"), "not a readable safetensors file"),
    )


def test_missing_or_corrupt_export(tiny_export, tmp_path, monkeypatch, capsys):
    expect_error(
        monkeypatch,
        capsys,
        "serve",
        "--backend",
        "onnxruntime",
        "--export",
        str(tmp_path / "none"),
        "--port",
        "0",
        fragments=(str(tmp_path / "none"), "export directory not found"),
    )
    broken = tmp_path / "export"
    shutil.copytree(tiny_export.path, broken)
    data = (broken / "weights.data").read_bytes()
    (broken / "weights.data").write_bytes(data[:100])
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--backend",
        "onnxruntime",
        "--export",
        str(broken),
        PROMPT,
        fragments=(str(broken / "weights.data"), "truncated", "dtrt export"),
    )


def test_int8_drafter_on_an_fp16_export(tiny, tmp_path, monkeypatch, capsys):
    expect_error(
        monkeypatch,
        capsys,
        "export",
        "--model",
        "tiny",
        "--dtype",
        "fp16",
        "--drafter-quant",
        "int8",
        "--out",
        str(tmp_path / "exp"),
        fragments=("--drafter-quant int8", "--dtype fp32"),
    )
    assert not (tmp_path / "exp").exists()


def test_mismatched_target_and_drafter(tiny, tmp_path, monkeypatch, capsys):
    wide = write_drafter(tmp_path / "wide", drafter_json(hidden=64, vocab=128))
    for cmd, *rest in (("run", "x"), ("serve", "--port", "0")):
        expect_error(
            monkeypatch,
            capsys,
            cmd,
            "--target",
            str(tiny.target),
            "--drafter",
            str(wide),
            "--method",
            "dflash",
            *rest,
            fragments=(str(wide), "hidden_size 64", "96"),
        )


def test_export_from_another_checkpoint(tiny, tiny_export, tmp_path, monkeypatch, capsys):
    other = tmp_path / "target"
    shutil.copytree(tiny.target, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--backend",
        "onnxruntime",
        "--export",
        str(tiny_export.path),
        "--target",
        str(other),
        PROMPT,
        fragments=(f"another target checkpoint than {other}",),
    )


def test_unknown_model_name(server, monkeypatch, capsys):
    for cmd, *rest in (("run", "x"), ("serve", "--port", "0")):
        expect_error(
            monkeypatch, capsys, cmd, "--model", "nope", *rest, fragments=("--model 'nope'", "unknown model", "tiny")
        )
    expect_http_error(
        f"{server.url}/v1/completions",
        404,
        {"model": "gpt-4", "prompt": PROMPT},
        param="model",
        fragments=("'gpt-4' not found", "'tiny'"),
    )


# prompts and context


def test_prompt_beyond_the_context(tiny, tiny_export, tmp_path, monkeypatch, capsys):
    short = tiny_variant(tiny, tmp_path / "target", max_positions=80)
    prompt = "A quick fox " * 5 + PROMPT  # 73 tokens; room for the prompt: 80 - 20 - (16 + 2) = 42
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--target",
        str(short.target),
        "--drafter",
        str(tiny.domino),
        "--max-new-tokens",
        "20",
        "--budget",
        "16",
        prompt,
        fragments=(
            "prompt (73 tokens) + --max-new-tokens 20 + one tree need 111 positions",
            f"max_position_embeddings in {short.target / 'config.json'} is 80",
            "--truncate to keep the prompt's last 42 tokens",
        ),
    )
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--backend",
        "onnxruntime",
        "--export",
        str(tiny_export.path),
        "--method",
        "ar",
        "--max-new-tokens",
        "100",
        "x" * 600,
        fragments=("prompt (600 tokens)", f"the max context of {tiny_export.path} is 512", "--max-context 718"),
    )
    short_pipe = pipe_for(short, spec("dominotree"))
    body = {"prompt": prompt, "max_tokens": 20}
    with BackgroundServer(short_pipe, ServeConfig("short")) as srv:
        expect_http_error(
            f"{srv.url}/v1/completions",
            400,
            body,
            param="prompt",
            fragments=("+ max_tokens 20 +", "`dtrt serve --truncate`"),
        )
    with BackgroundServer(short_pipe, ServeConfig("short", truncate=True)) as srv:
        status, reply = http(f"{srv.url}/v1/completions", body)
        assert status == 200 and reply["usage"]["prompt_tokens"] == 42


def test_max_new_tokens_beyond_the_context(server, monkeypatch, capsys):
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--model",
        "tiny",
        "--max-new-tokens",
        "5000",
        PROMPT,
        fragments=("--max-new-tokens 5000", "is 4096", "lower --max-new-tokens"),
    )
    expect_http_error(
        f"{server.url}/v1/completions",
        400,
        {"prompt": PROMPT, "max_tokens": 5000},
        param="max_tokens",
        fragments=("lower max_tokens",),
    )


def test_empty_prompt(server, monkeypatch, capsys):
    expect_error(monkeypatch, capsys, "run", "--model", "tiny", "", fragments=("the prompt is empty",))
    expect_http_error(
        f"{server.url}/v1/completions", 400, {"prompt": ""}, param="prompt", fragments=("the prompt is empty",)
    )


def test_chat_without_a_template(server, tmp_path, monkeypatch, capsys):
    expect_error(
        monkeypatch, capsys, "run", "--model", "tiny", "--chat", PROMPT, fragments=("--chat", "no chat template")
    )
    requests = tmp_path / "chat.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--model",
        "tiny",
        "--input",
        str(requests),
        fragments=(f"{requests}:1: messages", "no chat template"),
    )
    expect_http_error(
        f"{server.url}/v1/chat/completions",
        400,
        {"messages": [{"role": "user", "content": "hi"}]},
        param="messages",
        fragments=("no chat template", "/v1/completions"),
    )


def test_thinking_without_a_thinking_switch(tiny, tiny_chat, server, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--thinking (run, serve, bench) and chat_template_kwargs.enable_thinking (JSONL, HTTP) on a model whose chat
    template has no thinking mode, or that has no template."""
    for cmd, *rest in (("run", PROMPT), ("serve", "--port", "0")):
        expect_error(
            monkeypatch,
            capsys,
            cmd,
            "--model",
            "tiny",
            "--thinking",
            *rest,
            fragments=("--thinking: this model's tokenizer has no chat template; drop --thinking",),
        )
    chat = ("--target", str(tiny_chat.target), "--drafter", str(tiny.domino))
    expect_error(
        monkeypatch,
        capsys,
        "run",
        *chat,
        "--thinking",
        PROMPT,
        fragments=("--thinking: this model's chat template has no thinking mode (it never reads enable_thinking)",),
    )
    requests = tmp_path / "think.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}}
    requests.write_text(json.dumps(line) + "\n")
    expect_error(
        monkeypatch,
        capsys,
        "run",
        *chat,
        "--input",
        str(requests),
        fragments=(f"{requests}:1: chat_template_kwargs.enable_thinking: this model's chat template has no thinking",),
    )
    with BackgroundServer(pipe_for(tiny_chat, spec("ar")), ServeConfig("tiny-chat")) as chat_server:
        expect_http_error(
            f"{chat_server.url}/v1/chat/completions",
            400,
            line,
            param="chat_template_kwargs",
            fragments=("chat_template_kwargs.enable_thinking: this model's chat template has no thinking mode",),
        )


# flags and files


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("run", "--max-new-tokens", "0"), "--max-new-tokens 0: must be >= 1"),
        (("run", "--temperature", "-1"), "--temperature -1.0: must be >= 0"),
        (("run", "--temperature", "hot"), "Invalid value for '--temperature': 'hot' is not a valid float"),
        (("run", "--top-p", "0"), "--top-p 0.0: must be in (0, 1]"),
        (("run", "--seed", "-1"), "--seed -1: must be in [0, 2**63)"),
        (("run", "--stop", ""), "--stop: an empty stop string"),
        (("run", "--budget", "0"), "--budget 0: must be >= 1"),
        (("run", "--threads", "0"), "--threads 0: must be >= 1"),
        (("run", "--method", "beam"), "Invalid value for '--method': 'beam' is not one of"),
        (("serve", "--port", "70000"), "Invalid value for '--port': 70000 is not in the range"),
        (("serve", "--queue-limit", "-1"), "--queue-limit -1: must be >= 0"),
        (("serve", "--request-timeout", "0"), "--request-timeout 0.0: must be > 0"),
        (("serve", "--max-request-bytes", "100"), "--max-request-bytes 100: must be >= 1024"),
        (("serve", "--max-prompt-tokens", "0"), "--max-prompt-tokens 0: must be >= 1"),
        (("serve", "--api-key", " "), "--api-key: empty; give a key, or leave it out"),
        (("serve", "--replicas", "0"), "--replicas 0: must be >= 1"),
        (("serve", "--replicas", "2", "--max-replicas", "1"), "--max-replicas 1: must be >= --replicas 2"),
    ],
)
def test_invalid_flag_values(args, fragment, monkeypatch, capsys):
    expect_error(
        monkeypatch, capsys, *args, *(["--model", "tiny", "x"] if args[0] == "run" else []), fragments=(fragment,)
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("run", "--model", "tiny", "--device", "tpu", "x"), "--device 'tpu': use cpu, cuda or cuda:N"),
        (
            ("run", "--model", "tiny", "--backend", "onnxruntime", "--device", "cuda", "x"),
            "; pip uninstall -y onnxruntime && pip install onnxruntime-gpu",
        ),
        (
            ("bench", "--model", "tiny", "--datasets", "humaneval", "--quick", "--device", "cuda:x"),
            "--device 'cuda:x': use cpu, cuda or cuda:N",
        ),
        (
            ("run", "--model", "tiny", "--method", "ddtree", "--cuda-graph", "x"),
            "--cuda-graph: captures DominoTree's fixed-shape frontier build, not --method ddtree; use --method "
            "dominotree",
        ),
        (
            ("serve", "--model", "tiny", "--cuda-graph"),
            "--cuda-graph: captures the torch backend's drafting on a GPU; add --device cuda",
        ),
        (
            ("bench", "--model", "tiny", "--datasets", "humaneval", "--quick", "--cuda-graph"),
            "--cuda-graph: captures the torch backend's drafting on a GPU; add --device cuda",
        ),
    ],
)
def test_unusable_device_or_cuda_graph(args, fragment, monkeypatch, capsys):
    expect_error(monkeypatch, capsys, *args, fragments=(fragment,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu(tiny, monkeypatch, capsys):
    expect_error(
        monkeypatch,
        capsys,
        "serve",
        "--model",
        "tiny",
        "--device",
        "cuda",
        fragments=("--device cuda: torch ", "CPU-only build" if torch.version.cuda is None else "no CUDA"),
    )


def test_bad_jsonl_input(tiny, tmp_path, monkeypatch, capsys):
    expect_error(
        monkeypatch,
        capsys,
        "run",
        "--model",
        "tiny",
        "--input",
        str(tmp_path / "none.jsonl"),
        fragments=(f"--input {tmp_path / 'none.jsonl'}: not found",),
    )
    path = tmp_path / "requests.jsonl"
    for lines, fragment in (
        ([{"prompt": PROMPT}, "{oops"], f"{path}:2: not valid JSON"),
        ([{"prompt": PROMPT}, {"prompt": PROMPT, "max_tokens": 0}], f"{path}:2: max_tokens 0: must be >= 1"),
        ([{"text": PROMPT}], f"{path}:1: unknown parameter 'text'"),
        ([{"prompt": "x" * 5000}], f"{path}:1: the prompt (5000 tokens)"),
        ([], f"--input {path}: no requests in it"),
    ):
        path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
        expect_error(monkeypatch, capsys, "run", "--model", "tiny", "--input", str(path), fragments=(fragment,))
    expect_error(
        monkeypatch, capsys, "run", "--model", "tiny", "--input", str(path), PROMPT, fragments=("exclude each other",)
    )


def test_port_in_use(monkeypatch, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        expect_error(
            monkeypatch,
            capsys,
            "serve",
            "--port",
            str(port),
            fragments=(f"--host 127.0.0.1 --port {port}: cannot listen there", "pick another --port"),
        )


def test_serve_without_aiohttp(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp now fails
    for name in [m for m in sys.modules if m.startswith("dtrt.serve")]:
        monkeypatch.delitem(sys.modules, name)
    expect_error(monkeypatch, capsys, "serve", "--port", "0", fragments=('pip install "dtrt[serve]"',))


def test_replicas_without_ray(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    for args in (("--replicas", "2"), ("--ray-address", "auto")):
        expect_error(
            monkeypatch,
            capsys,
            "serve",
            "--port",
            "0",
            *args,
            fragments=(
                f'{" ".join(args)}: serving replicas needs Ray Serve, which is not installed: pip install "dtrt[ray]"',
            ),
        )


# HTTP requests


def test_malformed_http_body(tiny, server, monkeypatch):
    url = f"{server.url}/v1/completions"
    expect_http_error(url, 400, data=b"{prompt: 1", fragments=("not valid JSON",))
    expect_http_error(url, 400, data=b"\xff\xfe", fragments=("not valid JSON",))
    expect_http_error(url, 400, ["a prompt"], fragments=("must be a JSON object, not list",))
    with BackgroundServer(
        server.server.pipe, ServeConfig("tiny", max_request_bytes=1024, max_prompt_tokens=8)
    ) as small:
        expect_http_error(
            f"{small.url}/v1/completions",
            413,
            {"prompt": "x" * 4096},
            fragments=("larger than 1024 bytes (the server's --max-request-bytes)",),
        )
        err = expect_http_error(
            f"{small.url}/v1/completions",
            400,
            {"prompt": "The cat sees the dog and the moon"},
            param="prompt",
            fragments=("more than this server's --max-prompt-tokens 8; shorten it",),
        )
        assert err["code"] == "prompt_too_long"
        assert http(f"{small.url}/v1/completions", {"prompt": "The cat", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({}, "prompt", "'prompt' is required"),
        ({"prompt": 42}, "prompt", "prompt: must be a string"),
        ({"prompt": [1, 2, 3]}, "prompt", "token-id and batched prompts are not supported"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "max_tokens 'ten': must be an integer"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens 0: must be >= 1"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature -1.0: must be >= 0"),
        ({"prompt": "x", "top_p": 2}, "top_p", "top_p 2.0: must be in (0, 1]"),
        ({"prompt": "x", "seed": 1.5}, "seed", "seed 1.5: must be an integer"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop", "stop: must be a string or a list of strings"),
        ({"prompt": "x", "stream": "yes"}, "stream", "stream 'yes': must be true or false"),
        ({"prompt": "x", "messages": []}, "messages", "/v1/chat/completions takes 'messages'"),
        ({"prompt": "x", "n": 0}, "n", "n 0: must be an integer from 1 to 16"),
        ({"prompt": "x", "n": 17}, "n", "n 17: must be an integer from 1 to 16"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "best_of 3: not supported"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs 21: must be an integer from 0 to 20"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "logprobs True: must be an integer from 0 to 20"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "top_logprobs is a chat parameter"),
        ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools", "tools [{'type': 'function'}]: not supported"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "response_format.type 'xml': use"),
        ({"prompt": "x", "foo": 1}, "foo", "unknown parameter 'foo'"),
        (
            {"prompt": "x", "chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs",
            "chat_template_kwargs is a chat parameter; /v1/completions takes the prompt as raw text",
        ),
    ],
)
def test_bad_http_parameters(server, body, param, fragment):
    expect_http_error(f"{server.url}/v1/completions", 400, body, param=param, fragments=(fragment,))


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hi", "messages: must be a non-empty list"),
        ([{"role": "robot", "content": "hi"}], "messages[0]: needs a 'role' of"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
        ([{"role": "user"}], "messages[0].content: must be a string"),
    ],
)
def test_bad_chat_messages(server, messages, fragment):
    expect_http_error(
        f"{server.url}/v1/chat/completions", 400, {"messages": messages}, param="messages", fragments=(fragment,)
    )


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        ({"logprobs": 3}, "logprobs", "logprobs 3: must be true or false (top_logprobs sets the alternatives)"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs 21: must be an integer from 0 to 20"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens 0: must be >= 1"),
    ],
)
def test_bad_chat_parameters(server, fields, param, fragment):
    body = {"messages": [{"role": "user", "content": "hi"}]} | fields
    expect_http_error(f"{server.url}/v1/chat/completions", 400, body, param=param, fragments=(fragment,))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking 'yes': must be true or false"),
        ({"enable_thinking": True, "tools": []}, "chat_template_kwargs: only {'enable_thinking': true|false}"),
        ([True], "chat_template_kwargs: only {'enable_thinking': true|false}"),
    ],
)
def test_bad_chat_template_kwargs(server, tmp_path, kwargs, fragment, monkeypatch, capsys):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    expect_http_error(
        f"{server.url}/v1/chat/completions", 400, body, param="chat_template_kwargs", fragments=(fragment,)
    )
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps(body) + "\n")
    expect_error(
        monkeypatch, capsys, "run", "--model", "tiny", "--input", str(path), fragments=(f"{path}:1: {fragment}",)
    )


def test_unknown_route_and_method(server):
    expect_http_error(f"{server.url}/v1/embeddings", 404, {"input": "x"}, fragments=("no route /v1/embeddings",))
    expect_http_error(f"{server.url}/v1/completions", 405, method="GET", fragments=("GET /v1/completions",))

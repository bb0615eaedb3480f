"""`dtrt run`: the streamed text is the final text, stop strings cut the output without ever showing a part of
them that is later taken back, every method on both backends gives the AR text, JSONL in and out, the chat
template, context truncation, the interactive loop and Ctrl-C."""

import io
import json
import os
import shutil
import signal
import sys

import pytest
from helpers import pipe_for, run_cli, spec

from dtrt.cli import run as run_command
from dtrt.frontend import text as frontend_text
from dtrt.frontend.requests import Request, encode
from dtrt.frontend.text import TextStream, complete
from dtrt.models.pair import Pair
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.spec import METHODS

PROMPT = "The cat sees "
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_variant(tiny, path, chat_template=None, max_positions=None) -> Pair:
    """The tiny pair with its target copied to `path`, given a chat template and/or another context limit."""
    shutil.copytree(tiny.target, path)
    if chat_template is not None:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": chat_template}))
    if max_positions is not None:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": max_positions}))
    return Pair(path, tiny.dflash, tiny.domino)


@pytest.fixture(scope="session")
def tiny_chat(tiny, tmp_path_factory):
    """The tiny pair whose tokenizer has a chat template (the real one has none)."""
    return tiny_variant(tiny, tmp_path_factory.mktemp("chat") / "target", CHAT_TEMPLATE)


def on_tiny(*args):
    """`dtrt run` arguments on the tiny pair unless they name checkpoints or an export."""
    named = {"--model", "--target", "--export"} & set(args)
    return args if named else ("--model", "tiny", *args)


def run_json(monkeypatch, capsys, *args):
    code, out, err = run_cli(monkeypatch, capsys, "run", *on_tiny(*args), "--json")
    assert code == 0, err
    return json.loads(out)


class ByteTokenizer:
    """Byte-level ids decoded like a byte-level BPE: an incomplete UTF-8 character decodes to U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream_all(stream: TextStream, pieces) -> list[str]:
    shown = [stream.push(list(p)) for p in pieces]
    return shown + [stream.finish()]


def test_text_stream_holds_back_what_could_still_change():
    text = "Señor, the end is here. END"
    data = list(text.encode())
    stream = TextStream(ByteTokenizer(), ("END", "is here?"))
    shown = []
    for b in data:  # one byte per round: every prefix of the output is seen
        shown.append(stream.push([b]))
        so_far = "".join(shown)
        assert "\ufffd" not in so_far and text.startswith(so_far)
        assert not so_far.endswith(("E", "EN", "is", "is here")), so_far  # a possible stop start is held
        if stream.stopped:
            break
    assert "".join(shown) + stream.finish() == stream.text == "Señor, the end is here. "
    assert bytes(stream.tokens).decode() == "Señor, the end is here. END"  # up to the token completing the stop

    # several tokens per round, the stop string inside a round: the tokens after it are dropped
    stream = TextStream(ByteTokenizer(), ("the",))
    shown = stream_all(stream, [b"I see th", b"e cat"])
    assert shown == ["I see ", "", ""] and stream.text == "I see " and bytes(stream.tokens) == b"I see the"
    # no stop string: everything comes out, a held-back tail included, once the generation ends
    stream = TextStream(ByteTokenizer(), ("xyz",))
    assert stream_all(stream, [b"ab x", b"y"]) == ["ab ", "", "xy"] and not stream.stopped


def a_stop_word(text: str) -> str:
    """A word from the middle of `text`, to stop at."""
    words = [w for w in text.split(" ") if len(w) > 2]
    return words[len(words) // 2]


def test_every_method_on_both_backends_gives_the_ar_text(tiny, tiny_export, monkeypatch, capsys):
    backends = [("--model", "tiny"), ("--backend", "onnxruntime", "--export", str(tiny_export.path))]
    base = ("--max-new-tokens", "48", "--threads", "1")
    stop = a_stop_word(run_json(monkeypatch, capsys, "--method", "ar", *base, PROMPT)["text"])
    ref = run_json(monkeypatch, capsys, "--method", "ar", *base, "--stop", stop, PROMPT)
    assert ref["stop_reason"] == "stop" and ref["text"] and stop not in ref["text"]
    for backend in backends:
        for method in METHODS:
            res = run_json(monkeypatch, capsys, "--method", method, *backend, *base, "--stop", stop, PROMPT)
            assert res["text"] == ref["text"] and res["tokens"] == ref["tokens"], (method, backend)
            assert res["stop_reason"] == "stop"
            if method in ("ddtree", "dominotree"):
                assert res["tau"] > 2, (method, backend)


def test_streamed_text_is_the_json_text(tiny, monkeypatch, capsys):
    full = run_json(monkeypatch, capsys, "--max-new-tokens", "64", PROMPT)["text"]
    stops = ("at", a_stop_word(full))
    for args in (("--max-new-tokens", "64"), ("--max-new-tokens", "64", "--stop", stops[0], "--stop", stops[1])):
        code, out, err = run_cli(monkeypatch, capsys, "run", *on_tiny(*args), PROMPT)
        assert code == 0 and "tau" in err and "Traceback" not in err
        res = run_json(monkeypatch, capsys, *args, PROMPT)
        assert out == res["text"] + "\n"
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)
    assert res["stop_reason"] == "stop" and res["text"] == full[:cut]


def test_standard_input_and_jsonl(tiny, tiny_chat, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    from_stdin = run_json(monkeypatch, capsys, "--max-new-tokens", "24")
    assert from_stdin["text"] == run_json(monkeypatch, capsys, "--max-new-tokens", "24", PROMPT)["text"]

    expected = [
        run_json(monkeypatch, capsys, "--max-new-tokens", n, "--stop", "far", p)["text"]
        for p, n in ((PROMPT, "24"), ("Some old man ", "12"))
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        json.dumps({"id": "a", "prompt": PROMPT, "max_tokens": 24})
        + "\n\n"
        + json.dumps({"prompt": "Some old man ", "max_tokens": 12, "temperature": 0})
        + "\n"
    )
    code, out, err = run_cli(monkeypatch, capsys, "run", *on_tiny("--stop", "far", "--input", str(requests)))
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in lines] == expected and lines[0]["id"] == "a" and "id" not in lines[1]

    # a chat in a JSONL line goes through the template: the same as the prompt given as PROMPT (templated)
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}) + "\n")
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "run",
        "--target",
        str(tiny_chat.target),
        "--drafter",
        str(tiny.domino),
        "--input",
        str(requests),
    )
    chat = run_json(
        monkeypatch,
        capsys,
        "--target",
        str(tiny_chat.target),
        "--drafter",
        str(tiny.domino),
        "--max-new-tokens",
        "16",
        PROMPT,
    )
    assert code == 0 and json.loads(out)["text"] == chat["text"]
    assert json.loads(out)["prompt_tokens"] == chat["prompt_tokens"] == len(f"user: {PROMPT}\nassistant: ")


def test_chat_template_by_default(tiny, tiny_chat, monkeypatch, capsys):
    pair = ("--target", str(tiny_chat.target), "--drafter", str(tiny.domino), "--max-new-tokens", "16")
    chat = run_json(monkeypatch, capsys, *pair, PROMPT)
    raw = run_json(monkeypatch, capsys, *pair, "--no-chat", PROMPT)
    plain = run_json(monkeypatch, capsys, "--max-new-tokens", "16", PROMPT)  # the real tiny: no template
    assert chat["prompt_tokens"] == len(f"user: {PROMPT}\nassistant: ")
    assert raw["prompt_tokens"] == plain["prompt_tokens"] == len(PROMPT) and raw["text"] == plain["text"]


def test_truncate_keeps_the_prompt_tail(tiny, tmp_path, monkeypatch, capsys):
    short = tiny_variant(tiny, tmp_path / "target", max_positions=80)
    args = ("--target", str(short.target), "--drafter", str(tiny.domino), "--max-new-tokens", "20", "--budget", "16")
    prompt = "A quick fox " * 5 + PROMPT  # 73 characters; room = 80 - 20 - 16 - 2 = 42
    res = run_json(monkeypatch, capsys, *args, "--truncate", prompt)
    tail = run_json(monkeypatch, capsys, *args, prompt[-42:])
    assert res["prompt_tokens"] == 42 and res["tokens"] == tail["tokens"]


def interrupt_at_first_text(monkeypatch):
    """Ctrl-C (a real SIGINT to this process) as soon as the first text of a generation is shown."""
    real = frontend_text.complete  # which `dtrt run` imports when it generates

    def complete_interrupted(pipe, ids, max_new, sampling, stop, on_text, cancelled, **kw):
        sent = []

        def on_text_then_sigint(text):
            on_text(text)
            if not sent:
                sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)

        return real(pipe, ids, max_new, sampling, stop, on_text_then_sigint, cancelled, **kw)

    monkeypatch.setattr(frontend_text, "complete", complete_interrupted)


def test_ctrl_c_ends_the_generation_and_exits_130(tiny, monkeypatch, capsys):
    interrupt_at_first_text(monkeypatch)
    handler = signal.getsignal(signal.SIGINT)
    code, out, err = run_cli(monkeypatch, capsys, "run", *on_tiny("--method", "ar", "--max-new-tokens", "2000"), PROMPT)
    assert code == 130 and "(cancelled)" in err and "Traceback" not in err
    assert out.endswith("\n") and 0 < len(out) - 1 < 2000
    assert signal.getsignal(signal.SIGINT) is handler  # restored


def test_interactive_loop(tiny, monkeypatch):
    pipe = pipe_for(tiny, spec("dominotree"))
    defaults = Request(max_new_tokens=24)
    full = complete(pipe, encode(pipe.tokenizer, Request("Some old man "), False), 24, SamplingConfig()).text
    shown, logged = [], []

    def lines(items):
        it = iter(items)

        def read_line(prompt):
            shown.append(prompt)
            item = next(it)
            if isinstance(item, BaseException):
                raise item
            return item

        return read_line

    run_command.repl(
        pipe,
        defaults,
        False,
        False,
        lines(["Some old man ", "", "Some old man ", EOFError()]),
        shown.append,
        logged.append,
    )
    assert "".join(shown) == f"> {full}\n> > {full}\n> \n" and len(logged) == 2

    # Ctrl-C during the first generation stops it and the loop goes on; Ctrl-C at the prompt ends it
    shown.clear(), logged.clear()
    interrupt_at_first_text(monkeypatch)
    run_command.repl(
        pipe,
        Request(max_new_tokens=2000),
        False,
        False,
        lines(["Some old man ", "x" * 5000, KeyboardInterrupt()]),
        shown.append,
        logged.append,
    )
    assert "(cancelled)" in logged[0] and shown[0] == "> " and shown[-1] == "\n"
    assert logged[1].startswith("error: the prompt (5000 tokens)")  # an error is one line; the loop goes on
    assert len(logged) == 2 and shown.count("> ") == 3


def test_interactive_loop_is_one_conversation_through_the_chat_template(tiny, monkeypatch):
    pipe = pipe_for(tiny, spec("dominotree"))
    monkeypatch.setattr(
        pipe.tokenizer,
        "chat_template",
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        raising=False,
    )
    prompts, shown, logged = [], [], []
    real = run_command.prompt_ids
    monkeypatch.setattr(
        run_command,
        "prompt_ids",
        lambda p, req, chat, truncate: prompts.append(req.messages) or real(p, req, chat, truncate),
    )
    lines = iter(["Some old man ", "The cat sees ", "/new", "Water boils at ", EOFError()])

    def read_line(prompt):
        item = next(lines)
        if isinstance(item, BaseException):
            raise item
        return item

    run_command.repl(pipe, Request(max_new_tokens=8), True, False, read_line, shown.append, logged.append)
    first_reply = "".join(shown).split("\n")[0].removeprefix("> ")
    assert prompts[0] == [{"role": "user", "content": "Some old man "}]
    assert prompts[1] == [
        {"role": "user", "content": "Some old man "},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "The cat sees "},
    ]
    assert prompts[2] == [{"role": "user", "content": "Water boils at "}] and "(new conversation)" in logged

    # the oldest exchanges are dropped when the conversation outgrows the context
    room = pipe.prompt_room(8)
    monkeypatch.setattr(pipe, "prompt_room", lambda n: 60)
    prompts.clear(), logged.clear()
    lines = iter(["a " * 20, "b " * 20, "c " * 20, EOFError()])
    run_command.repl(pipe, Request(max_new_tokens=8), True, False, read_line, shown.append, logged.append)
    assert room > 60 and [m["content"] for m in prompts[-1] if m["role"] == "user"][0] != "a " * 20
    assert any("oldest exchanges no longer fit" in m for m in logged)


def test_budget_defaults_to_the_models_measured_one(tiny, monkeypatch, capsys):
    from dataclasses import replace

    from dtrt.zoo import registry

    assert registry.default_budget("smollm2-135m") == 4 and registry.default_budget(None) == 16
    # the embedded default on ONNX Runtime runs its GGUF file's blocks (gguf, which passes the quality gate) with
    # dominotree with lookup's chains at that quantization's budget (gguf, int8, int4: 2; fp32: 4; int8/int4 without
    # the chains: 1); cadominotree's budget is a cap, 16
    from dtrt.launch import resolve_spec

    default, on_torch = resolve_spec(), resolve_spec(model="smollm2-135m", method="dominotree")
    assert (default.backend, default.quant, default.method, default.budget) == ("onnxruntime", "gguf", "dominotree", 2)
    assert resolve_spec(quant="none").budget == 4
    int8 = resolve_spec(quant="int8")
    assert (int8.quant, int8.method, int8.lookup, int8.budget) == ("int8", "dominotree", True, 2)
    assert resolve_spec(method="cadominotree", quant="int8").budget == 16
    assert (on_torch.backend, on_torch.quant, on_torch.budget) == ("torch", None, 4)
    assert resolve_spec(method="ddtree", quant="none").budget == 4
    assert resolve_spec(method="dominotree", quant="int4").budget == 2
    assert resolve_spec(method="dominotree", quant="int4", lookup=False).budget == 1
    assert resolve_spec(model="tiny").method == "dominotree" and registry.default_method("qwen3-4b") == "dominotree"
    # the first-use export's drafter: the int4 lm_head where the budget is 1 or 2, the int8 one on fp32's budget 4
    quants = [registry.default_drafter_quant("smollm2-135m", q) for q in ("none", "int8", "int4")]
    assert quants == ["int8", "int4", "int4"] and registry.default_drafter_quant("tiny", "int4") == "int8"
    vocabs = [registry.default_draft_vocab("smollm2-135m", q) for q in ("none", "int8", "int4")]
    assert (
        vocabs == [None, "d2t-8k.safetensors", "d2t-8k.safetensors"]
        and registry.default_draft_vocab("tiny", "int4") is None
    )
    assert run_json(monkeypatch, capsys, "--max-new-tokens", "4", PROMPT)["budget"] == 16
    monkeypatch.setitem(registry.MODELS, "tiny", replace(registry.MODELS["tiny"], budget=3))
    out = run_json(monkeypatch, capsys, "--max-new-tokens", "24", PROMPT)
    assert out["budget"] == 3 and max(out["tree_sizes"]) == 4
    assert run_json(monkeypatch, capsys, "--budget", "5", "--max-new-tokens", "4", PROMPT)["budget"] == 5


def test_lookup_flag_on_the_tree_methods(tiny, monkeypatch, capsys):
    base = ("--max-new-tokens", "32", "--threads", "1")
    ref = run_json(monkeypatch, capsys, "--method", "ar", *base, PROMPT)
    prompt = PROMPT + ref["text"] + PROMPT
    want = run_json(monkeypatch, capsys, "--method", "ar", *base, prompt)["tokens"]
    for method in ("dominotree", "cadominotree"):
        res = run_json(monkeypatch, capsys, "--method", method, "--lookup", *base, prompt)
        assert res["tokens"] == want and len(res["from_lookup"]) == res["rounds"], method
    code, _, err = run_cli(monkeypatch, capsys, "run", *on_tiny("--method", "ddtree", "--lookup", PROMPT))
    assert code == 2 and "--lookup" in err and len(err.strip().splitlines()) == 1, err

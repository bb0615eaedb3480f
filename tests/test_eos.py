"""End of sequence: every id of config.json, generation_config.json (an id or a list) and the tokenizer's EOS ends a
generation, on the torch backend and on an export (whose tokenizer/ carries generation_config.json); a malformed
generation_config.json is a one-line error naming it."""

import json
import shutil

import pytest
from helpers import pipe_for, run_cli, spec

from dtrt.artifacts.files import MANIFEST, write_manifest
from dtrt.errors import DtrtError
from dtrt.models.config import generation_eos
from dtrt.runtime.pipeline import stop_ids
from dtrt.runtime.sampling import SamplingConfig
from dtrt.runtime.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The cat sees "
NEW = 40


def run_json(monkeypatch, capsys, *args):
    code, out, err = run_cli(monkeypatch, capsys, "run", *args, "--max-new-tokens", str(NEW), "--json", PROMPT)
    assert code == 0, err
    return json.loads(out)


def with_generation_config(src, dst, eos):
    """A copy of the checkpoint or tokenizer directory `src` whose generation_config.json lists `eos`."""
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": eos}))
    return dst


def first_seen(tokens, after: int) -> list[tuple[int, int]]:
    """(token, index of its first occurrence) for the tokens first seen at index >= `after`, in order."""
    seen = {}
    for i, t in enumerate(tokens):
        seen.setdefault(t, i)
    return sorted(((t, i) for t, i in seen.items() if i >= after), key=lambda x: x[1])


@pytest.fixture(scope="module")
def reference(tiny):
    """The tiny pair's DominoTree tokens for PROMPT (no EOS among them) and two ids to declare EOS: `a` first seen
    before `b`, both well inside the generation, where verify rounds commit several tokens at once."""
    pipe = pipe_for(tiny, spec("dominotree"), threads=1)
    out = pipe.generate(pipe.tokenizer.encode(PROMPT, add_special_tokens=False), NEW, SamplingConfig())
    assert out.stop_reason == "length" and len(out.tokens) == NEW and out.tau > 1.5
    (a, ja), *rest = first_seen(out.tokens, 5)
    b, jb = next((t, j) for t, j in rest if j >= ja + 5)
    return out.tokens, (a, ja), (b, jb)


def test_generation_config_eos_ids(tmp_path):
    assert generation_eos(tmp_path) == ()  # no file
    for eos, want in ((7, (7,)), ([151645, 151643], (151645, 151643)), (None, ())):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert generation_eos(tmp_path) == want
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert generation_eos(tmp_path) == ()
    for bad in ('{"eos_token_id": "</s>"}', '{"eos_token_id": [1, "x"]}', '{"eos_token_id": true}', "[1]", "{oops"):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(DtrtError) as e:
            generation_eos(tmp_path)
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path / "generation_config.json") in msg, msg
        assert "restore the file" in msg


def test_stop_ids_is_the_union(tiny, tmp_path):
    tok = load_tokenizer(tiny.target)
    assert tok.eos_token_id == 0
    folder = with_generation_config(tiny.target, tmp_path / "t", [0, 42, 17])
    assert stop_ids((5,), tok, folder) == (0, 5, 17, 42)
    assert stop_ids((), tok, tiny.target) == (0,)


def test_every_eos_id_stops_the_generation_on_torch(tiny, reference, tmp_path, monkeypatch, capsys):
    tokens, (a, ja), (b, jb) = reference
    assert (
        run_json(monkeypatch, capsys, "--target", str(tiny.target), "--drafter", str(tiny.domino))["tokens"] == tokens
    )
    cases = (
        (b, jb),  # an id alone
        ([0, b], jb),  # a list beside config.json's own
        ([b, a], ja),  # the first of them to come
    )
    for i, (eos, j) in enumerate(cases):
        target = with_generation_config(tiny.target, tmp_path / f"t{i}", eos)
        out = run_json(monkeypatch, capsys, "--target", str(target), "--drafter", str(tiny.domino))
        assert out["stop_reason"] == "eos" and out["tokens"] == tokens[: j + 1], eos

    # the tokenizer's EOS: here the character `a` is declared the end of text
    target = tmp_path / "tok"
    shutil.copytree(tiny.target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    char = load_tokenizer(tiny.target).convert_ids_to_tokens(a)
    (target / "tokenizer_config.json").write_text(json.dumps(cfg | {"eos_token": char}))
    assert load_tokenizer(target).eos_token_id == a
    out = run_json(monkeypatch, capsys, "--target", str(target), "--drafter", str(tiny.domino))
    assert out["stop_reason"] == "eos" and out["tokens"] == tokens[: ja + 1]


def test_every_eos_id_stops_the_generation_on_an_export(tiny_export, reference, tmp_path, monkeypatch, capsys):
    tokens, _, (b, jb) = reference
    plain = run_json(monkeypatch, capsys, "--export", str(tiny_export.path), "--method", "dominotree")
    assert plain["tokens"] == tokens  # the export alone: no extra EOS
    path = tmp_path / "export"
    shutil.copytree(tiny_export.path, path)
    assert not (path / "tokenizer" / "generation_config.json").exists()
    (path / "tokenizer" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, b]}))
    write_manifest(path, json.loads((path / MANIFEST).read_text()))
    out = run_json(monkeypatch, capsys, "--export", str(path), "--method", "dominotree")
    assert out["stop_reason"] == "eos" and out["tokens"] == tokens[: jb + 1]

    (path / "tokenizer" / "generation_config.json").write_text('{"eos_token_id": "x"}')
    write_manifest(path, json.loads((path / MANIFEST).read_text()))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--export", str(path), PROMPT)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert str(path / "tokenizer" / "generation_config.json") in err and "eos_token_id 'x'" in err

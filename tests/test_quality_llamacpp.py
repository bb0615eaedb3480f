"""dtrt quality's llama.cpp row without llama.cpp: a stand-in Llama with known logits through the row's own code
(the child process's included), the row compared and rendered by quality.py's functions beside the others and not
gated, a child that dies of SIGILL once run again with repacking off, and the line that says why the row is omitted."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from dtrt.bench import quality as q
from dtrt.bench import quality_llamacpp as lq
from dtrt.bench.quality import Candidate, Text, _argmax_nll, quality, table

VOCAB, EOS = 8, 7


def known_logits(token: int) -> np.ndarray:
    """The stand-in's logits after `token`: peaked at token + 1, so greedy counts up to EOS."""
    return -np.abs(np.arange(VOCAB) - (token + 1) % VOCAB).astype(np.float32)


class FakeLlama:
    """llama_cpp.Llama as the row uses it: reset, eval and the scores of every position (logits_all)."""

    def __init__(self, model_path=None, n_ctx=64, use_extra_bufts=True, **kwargs):
        self.scores, self.n_tokens, self.repack = np.zeros((n_ctx, VOCAB), np.float32), 0, use_extra_bufts

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        for t in tokens:
            self.scores[self.n_tokens] = known_logits(t)
            self.n_tokens += 1

    def token_eos(self):
        return EOS


def test_every_positions_logits_give_the_argmax_nll_and_greedy_answers():
    text, prompt = [0, 3, 4, 1, 2], [5, 2]
    got = lq.llamacpp_measure(FakeLlama(), [text], [prompt], max_new_tokens=10, eos={EOS}, isa="fake")
    argmax, nll = _argmax_nll(torch.from_numpy(np.stack([known_logits(t) for t in text])), text)
    assert got["argmax"] == [argmax.tolist()] == [[1, 4, 5, 2]] and got["nll"] == [nll.tolist()]
    assert got["answers"] == [[3, 4, 5, 6, 7]]  # its stop token included, as dtrt's answers
    short = lq.llamacpp_measure(FakeLlama(), [], [prompt], max_new_tokens=2, eos={EOS}, isa="fake")
    assert short["answers"] == [[3, 4]] and got["name"] == "llama.cpp"


class Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [int(c) for c in text]


def test_the_row_is_rendered_beside_the_others_and_not_gated(monkeypatch):
    """The reference is a recorded measure; the llama.cpp row comes from the stand-in through quality()."""
    texts = [Text("humaneval", "0", "0123456"), Text("mt-bench", "1", "0124")]
    prompts = [("humaneval", "3"), ("mt-bench", "5")]
    reference = {
        "name": "torch fp32",
        "argmax": [[1, 2, 3, 4, 5, 6], [1, 2, 0]],  # the stand-in's last argmax of the second text is 3
        "nll": [[0.5] * 6, [0.5] * 3],
        "answers": [[4, 5, 6, 7], [6, 7]],
        "tok_s": 10.0,
        "isa": "AVX512",
    }
    monkeypatch.setattr(q, "measure", lambda cand, seqs, prompts, **kw: reference)
    peer = lambda seqs, ids, n: lq.llamacpp_measure(FakeLlama(), seqs, ids, max_new_tokens=n, eos={EOS}, isa="fake")  # noqa: E731
    ref = Candidate("torch fp32", target="t")
    rows = quality(ref, [ref], texts, prompts, Tokenizer(), max_tokens=16, max_new_tokens=8, threads=1, peer=peer)
    ours, peers = rows[:2], rows[2:]
    assert [r["quant"] for r in peers] == ["llama.cpp", "llama.cpp"] and all(not r["gated"] for r in peers)
    he, mt = peers
    assert he["agreement"] == 1.0 and he["identical"] == 1.0 and mt["agreement"] == 2 / 3
    assert he["nll_delta"] == pytest.approx(np.mean(_argmax_nll(torch.tensor(np.stack([known_logits(t) for t in
        [0, 1, 2, 3, 4, 5, 6]])), list(range(7)))[1]) - 0.5)  # fmt: skip
    rendered = table(rows, "torch fp32").splitlines()
    assert len(rendered) == 6 and rendered[2].startswith("| torch fp32 |") and rendered[2].endswith("| pass |")
    assert rendered[4].startswith("| llama.cpp |") and "| not gated (would fail: nll +0.2" in rendered[4]
    assert rendered[5].startswith("| llama.cpp |") and "| not gated (would fail: agreement 0.6667 < 0.99" in rendered[5]
    assert ours[0]["gate"] == [] and "gated" not in ours[0]


def _fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama, module.__version__ = FakeLlama, "0.0-fake"
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def test_the_child_process_measures_through_llama_cpp(tmp_path, monkeypatch):
    _fake_llama_cpp(monkeypatch)
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    req = {"gguf": "m.gguf", "threads": 1, "n_ctx": 32, "seqs": [[0, 3, 4]], "prompts": [[5]], "max_new_tokens": 4,
           "eos": [EOS]}  # fmt: skip
    request.write_text(json.dumps(req))
    lq.main([str(request), str(result)])
    got = json.loads(result.read_text())
    assert got["argmax"] == [[1, 4]] and got["answers"] == [[6, 7]] and got["isa"] == "llama-cpp-python 0.0-fake"


SIGILL_ONCE = (
    "import os, signal, sys\n"
    "if '--no-repack' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
    'open(sys.argv[2], \'w\').write(\'{"name": "llama.cpp", "argmax": [], "nll": [], "answers": []}\')\n'
)


def test_a_child_that_dies_of_sigill_once_runs_again_with_repacking_off(tmp_path):
    lines = []
    command = lambda request, result: [sys.executable, "-c", SIGILL_ONCE, str(request), str(result)]  # noqa: E731
    got = lq.measure_llamacpp(
        tmp_path / "m.gguf", [[1, 2]], [], max_new_tokens=4, threads=None, eos=[EOS], log=lines.append, command=command
    )
    assert got["name"] == "llama.cpp (repacking off)"
    assert "died of an illegal instruction (SIGILL) with its weight repacking on" in lines[1]
    dead = lambda request, result: [sys.executable, "-c", "import sys; sys.exit('no model')"]  # noqa: E731
    lines.clear()
    assert lq.measure_llamacpp(tmp_path / "m.gguf", [[1, 2]], [], max_new_tokens=4, threads=1, eos=[], log=lines.append,
                               command=dead) is None  # fmt: skip
    assert lines[-1] == "llama.cpp row failed: llama.cpp exited with status 1 (no model)"


def test_without_llama_cpp_python_the_row_is_omitted_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(lq.importlib.util, "find_spec", lambda name: None)
    lines = []
    assert lq.llamacpp_peer(tmp_path / "m.gguf", threads=1, eos=[], log=lines.append) is None
    assert lines == [lq.OMITTED] and lines[0].startswith("llama.cpp row omitted: llama-cpp-python is not installed")
    assert 'the dtrt[llamacpp] extra: pip install -e ".[llamacpp]"' in lines[0]

"""`dtrt drafter-data` on the tiny target: shards and their rows, resume after an interrupted run (the same rows as
an uninterrupted run, none twice), sampled rows reproduced by their seed, multi-turn rows, the continuous-batching
decoder against AR, `dtrt train-drafter --data`, and the bad inputs (one line each)."""

import collections
import fcntl
import json
import shutil

import pytest
import torch
from helpers import pipe_for, run_cli, spec
from test_bad_input import expect_error

from dtrt.runtime.sampling import SamplingConfig
from dtrt.train import datagen, store
from dtrt.train.config import DataGenConfig
from dtrt.train.data import decode_pool
from dtrt.train.datagen import drafter_data, load_rows, read_progress
from dtrt.zoo import tiny as tiny_mod

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    {"prompt": "The cat sees "},
    {"turns": ["A quick fox ", "The dog "]},
    {"prompt": "Every king walks "},
    {"messages": [{"role": "user", "content": "The moon is very "}, {"role": "user", "content": "Some old man "}]},
    {"prompt": "A small bird "},
    {"prompt": "One happy child "},
    {"turns": ["The dog ", "A small bird ", "The cat sees "]},
]
# small rows, shards of 3 (prompt, sample) pairs, batches of 4: several shards, refills and turns per shard
SMALL = ["--samples", "2", "--max-new-tokens", "20", "--shard-rows", "3", "--batch", "4"]
CORPUS = ["--corpus-row-tokens", "64"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("datagen")
    (d / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    (d / "corpus.txt").write_text(tiny_mod.corpus(600, 3))  # 9 rows of 64 tokens: 3 corpus shards
    return d


def make(monkeypatch, capsys, out, *args):
    code, stdout, err = run_cli(
        monkeypatch, capsys, "drafter-data", "--model", "tiny", "--out", str(out), *SMALL, *args
    )
    assert code == 0, err
    return stdout, err


def rows_of(path, tiny):
    rows, _ = load_rows(path, tiny.target)
    return [(r.prompt, r.sample, r.turn, r.response_start, tuple(r.tokens)) for r in rows]


@pytest.fixture(scope="module")
def full(tiny, inputs, tmp_path_factory):
    """An uninterrupted run over the prompts and the corpus (what `make` with the same flags writes)."""
    out = tmp_path_factory.mktemp("full") / "data"
    cfg = DataGenConfig(samples=2, max_new_tokens=20, shard_rows=3, batch=4, corpus_row_tokens=64)
    prompts, corpus = str(inputs / "prompts.jsonl"), (str(inputs / "corpus.txt"),)
    drafter_data(tiny.target, out, cfg, prompts, corpus, name="tiny", log=lambda msg: None)
    return out


def test_shards_and_rows(tiny, full):
    progress = read_progress(full)
    r, c = progress["responses"], progress["corpus"]
    n_units = len(PROMPTS) * 2
    assert r["units"] == r["done_units"] == n_units and len(r["shards"]) == -(-n_units // 3)
    assert sorted(p.name for p in full.glob("*.safetensors")) == sorted(s["file"] for s in r["shards"] + c["shards"])
    assert not list(full.glob(".*.tmp-*"))
    rows = rows_of(full, tiny)
    turns = sum(len(p.get("turns") or p.get("messages") or [0]) for p in PROMPTS)
    responses = [x for x in rows if x[0] >= 0]
    assert len(responses) == r["rows"] == 2 * turns
    assert len({x[:3] for x in responses}) == len(responses)  # one row per (prompt, sample, turn)
    assert r["response_tokens"] == sum(len(x[4]) - x[3] for x in responses)
    corpus = [x for x in rows if x[0] < 0]
    assert len(corpus) == c["rows"] > 0 and all(len(x[4]) == 64 for x in corpus)

    # greedy rows are the target's AR tokens after the prompt, cut after a stop token
    pipe = pipe_for(tiny, spec("ar"))
    tok = pipe.tokenizer
    for prompt, sample, turn, start, tokens in responses:
        if sample == 0 and turn == 0:
            first = PROMPTS[prompt].get("prompt") or (PROMPTS[prompt].get("turns") or [None])[0]
            first = first or PROMPTS[prompt]["messages"][0]["content"]
            ids = tok.encode(first, add_special_tokens=False)
            assert list(tokens[:start]) == ids
            ar = pipe.generate(ids, 20, SamplingConfig()).tokens
            assert list(tokens[start:]) == ar[: len(tokens) - start]

    # a later turn continues from the target's own earlier answer (no chat template: plain text)
    by_key = {x[:3]: x for x in responses}

    def text(row, part):
        return tok.decode(list(row[4][: row[3]] if part == "prompt" else row[4][row[3] :]), skip_special_tokens=True)

    for sample in (0, 1):
        first, second, third = (by_key[(6, sample, t)] for t in range(3))
        assert text(second, "prompt") == "The dog " + text(first, "answer") + "\n\nA small bird "
        assert text(third, "prompt") == text(second, "prompt") + text(second, "answer") + "\n\nThe cat sees "
    # sampled rows differ from the greedy ones
    assert any(by_key[(p, 0, 0)][4] != by_key[(p, 1, 0)][4] for p in range(len(PROMPTS)))


def test_resume_after_interruption(tiny, full, inputs, tmp_path, monkeypatch, capsys):
    """Stop after two shards, then a run killed while writing its next shard, then --resume: the same rows as the
    uninterrupted run, none twice, no temporary files left."""
    out = tmp_path / "data"
    args = ("--prompts", str(inputs / "prompts.jsonl"), "--corpus", str(inputs / "corpus.txt"), *CORPUS)
    make(monkeypatch, capsys, out, *args, "--max-shards", "2")
    first = read_progress(out)
    assert len(first["corpus"]["shards"]) == 2 and not first["responses"]["shards"]

    real, written = datagen.save_file, []

    def dies_midway(tensors, path, metadata=None):
        if path.name.startswith(".responses-"):
            written.append(path)
            if len(written) == 2:  # this run's second responses shard: half a file, then the process is gone
                path.write_bytes(b"partial")
                raise KeyboardInterrupt
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(datagen, "save_file", dies_midway)
    code, _, _ = run_cli(
        monkeypatch, capsys, "drafter-data", "--model", "tiny", "--out", str(out), *SMALL, *args, "--resume"
    )
    assert code == 130 and list(out.glob(".*.tmp-*"))  # interrupted, a temporary file left behind
    done = read_progress(out)
    assert len(done["corpus"]["shards"]) == 3 and len(done["responses"]["shards"]) == 1
    monkeypatch.setattr(datagen, "save_file", real)

    stdout, err = make(monkeypatch, capsys, out, *args, "--resume")
    assert not list(out.glob(".*.tmp-*"))
    progress = read_progress(out)
    assert progress["responses"]["done_units"] == len(PROMPTS) * 2
    assert len(progress["responses"]["shards"]) > len(done["responses"]["shards"])
    got, want = rows_of(out, tiny), rows_of(full, tiny)
    assert got == want
    assert len(set(got)) == len(got)
    assert progress["responses"]["rows"] == read_progress(full)["responses"]["rows"]


def test_resume_after_a_kill_in_the_first_shard(tiny, full, inputs, tmp_path, monkeypatch, capsys):
    """A run killed before its first progress file leaves only its lock and a temporary file: --resume starts it
    over."""
    out = tmp_path / "data"

    def dies(tensors, path, metadata=None):
        path.write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(datagen, "save_file", dies)
    args = ("--model", "tiny", "--out", str(out), *SMALL, "--prompts", str(inputs / "prompts.jsonl"))
    assert run_cli(monkeypatch, capsys, "drafter-data", *args)[0] == 130
    assert read_progress(out) is None and list(out.glob(".*.tmp-*"))
    monkeypatch.undo()
    assert "holds no drafter data" in run_cli(monkeypatch, capsys, "drafter-data", *args)[2]
    make(monkeypatch, capsys, out, "--prompts", str(inputs / "prompts.jsonl"), "--resume")
    assert rows_of(out, tiny) == [x for x in rows_of(full, tiny) if x[0] >= 0]


def test_sampled_rows_reproducible_by_seed(tiny, inputs, tmp_path, monkeypatch, capsys):
    args = ("--prompts", str(inputs / "prompts.jsonl"))
    runs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        make(monkeypatch, capsys, tmp_path / name, *args, "--seed", seed)
        runs[name] = {x[:3]: x[4] for x in rows_of(tmp_path / name, tiny)}
    assert runs["a"] == runs["b"]
    greedy = [k for k in runs["a"] if k[1] == 0 and k[2] == 0]
    sampled = [k for k in runs["a"] if k[1] == 1 and k[2] == 0]
    assert all(runs["a"][k] == runs["c"][k] for k in greedy)
    assert any(runs["a"][k] != runs["c"][k] for k in sampled)


def test_decode_pool_equals_ar(tiny):
    """Continuous batching (fewer rows than prompts, so rows are refilled; a prompt given twice shares its
    prefill) gives each prompt's AR tokens, cut after a stop token; a sampled row depends on its seed only."""
    pipe = pipe_for(tiny, spec("ar"))
    texts = ["The cat sees ", "A quick fox ", "Every king walks ", "The moon is very ", "The dog ", "The dog "]
    ids = [pipe.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ar = [pipe.generate(p, 24, SamplingConfig()).tokens for p in ids]
    stop = (ar[0][6],)
    target = pipe.backend.target
    got = {}
    queue = collections.deque((i, p, None) for i, p in enumerate(ids))
    decode_pool(target, queue, 3, 24, 64, lambda k, t: got.__setitem__(k, list(t)), stop=stop)
    for i, tokens in enumerate(ar):
        assert got[i] == tokens[: next((j + 1 for j, t in enumerate(tokens) if t in stop), 24)]

    def sampled(batch, seed):
        out = {}
        queue = collections.deque((i, p, torch.Generator().manual_seed(seed + i)) for i, p in enumerate(ids))
        decode_pool(target, queue, batch, 24, 64, lambda k, t: out.__setitem__(k, list(t)), temperature=1.0, top_p=0.9)
        return out

    assert sampled(2, 0) == sampled(5, 0) != sampled(2, 100)


def test_train_drafter_reads_shards(tiny, full, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(
        monkeypatch,
        capsys,
        "train-drafter",
        "--model",
        "tiny",
        "--out",
        str(out),
        "--data",
        str(full),
        "--seq-len",
        "48",
        "--block-size",
        "4",
        "--gru-dim",
        "16",
        "--emb-dim",
        "16",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--eval-prompts",
        "2",
        "--eval-tokens",
        "12",
    )
    assert code == 0, err
    assert "after 4 steps" in stdout and (out / "domino" / "model.safetensors").is_file()
    data = store.load(out / ".train" / "data")
    responses = [x for x in rows_of(full, tiny) if x[0] >= 0]
    assert len(data) >= len(responses)


def test_bad_inputs(tiny, full, inputs, tmp_path, monkeypatch, capsys):
    def fails(*args, fragments):
        return expect_error(monkeypatch, capsys, "drafter-data", *args, fragments=fragments)

    new = ("--model", "tiny", "--out", str(tmp_path / "new"))
    fails(*new, "--prompts", str(tmp_path / "missing.jsonl"), fragments=["missing.jsonl: not found"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "The cat "}\n{"prompt": \n')
    fails(*new, "--prompts", str(bad), fragments=["bad.jsonl:2: not valid JSON"])
    bad.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    fails(*new, "--prompts", str(bad), fragments=["bad.jsonl:1: messages[1] is an assistant message"])
    bad.write_text('{"text": "a"}\n')
    fails(*new, "--prompts", str(bad), fragments=["bad.jsonl:1: needs a non-empty 'prompt', 'turns' or 'messages'"])
    fails(*new, fragments=["give --prompts FILE and/or --corpus PATH"])
    prompts = ("--prompts", str(inputs / "prompts.jsonl"))
    fails(*new, *prompts, "--samples", "2", "--temperature", "0", fragments=["sampled responses need a temperature"])
    fails(*new, *prompts, "--top-p", "0", fragments=["--top-p 0.0: must be in (0, 1]"])
    fails(*new, *prompts, "--batch", "0", fragments=["--batch 0: must be >= 1"])
    assert not (tmp_path / "new").exists()

    # an --out that holds data (or anything else) without --resume
    args = (*SMALL, *prompts, "--corpus", str(inputs / "corpus.txt"), *CORPUS)
    fails("--model", "tiny", "--out", str(full), *args, fragments=["already holds drafter data; pass --resume"])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    fails("--model", "tiny", "--out", str(tmp_path / "other"), *prompts, fragments=["not empty and holds no drafter"])
    fails("--model", "tiny", "--out", str(tmp_path / "other"), *prompts, "--resume", fragments=["holds no drafter"])
    # a run still writing --out
    with open(full / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        fails("--model", "tiny", "--out", str(full), *args, "--resume", fragments=["another dtrt drafter-data run"])
    # --resume with another target, other prompts or other row options
    other = tmp_path / "other-target"
    shutil.copytree(tiny.target, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rope_theta": 20000.0}))
    fails("--target", str(other), "--out", str(full), *args, "--resume", fragments=["made with the target tiny, not"])
    fails("--model", "tiny", "--out", str(full), *args, "--resume", "--samples", "3", fragments=["--samples was 2"])
    fails(
        "--model",
        "tiny",
        "--out",
        str(full),
        *SMALL,
        "--prompts",
        str(inputs / "corpus.txt"),
        "--resume",
        fragments=["--prompts differs from the run being resumed"],
    )
    # train-drafter --data: a directory without data, or data of another target
    err = expect_error(
        monkeypatch, capsys, "train-drafter", "--target", str(other), "--out", str(tmp_path / "t1"), "--data", str(full)
    )
    assert "made with the target tiny" in err
    err = expect_error(
        monkeypatch, capsys, "train-drafter", "--model", "tiny", "--out", str(tmp_path / "t2"), "--data", str(tmp_path)
    )
    assert "no progress.json" in err

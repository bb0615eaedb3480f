"""`dtrt train-drafter` on the tiny target: released layouts, held-out tau, best checkpoint, resume."""

import json
import sys

import pytest
from helpers import pipe_for, spec

from dtrt import cli
from dtrt.models.checkpoint import check_pair, load_drafter, load_target
from dtrt.models.pair import Pair
from dtrt.runtime.sampling import SamplingConfig
from dtrt.zoo import tiny as tiny_mod

PROMPTS = [
    "The cat sees ",
    "A quick fox ",
    "Every king walks ",
    "The moon is very ",
    "Some old man reads ",
    "The dog ",
    "A small bird ",
    "One happy child ",
]
SMALL = [
    "--seq-len",
    "64",
    "--block-size",
    "6",
    "--gru-dim",
    "16",
    "--emb-dim",
    "16",
    "--batch",
    "8",
    "--anchors",
    "4",
    "--lr",
    "3e-3",
    "--eval-prompts",
    "2",
    "--eval-tokens",
    "24",
    "--gen-tokens",
    "32",
    "--corpus-rows",
    "64",
]


def train(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["dtrt", "train-drafter", "--model", "tiny", *SMALL, *args])
    cli.main()
    return capsys.readouterr()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    (d / "corpus.txt").write_text(tiny_mod.corpus(20000, 7))
    (d / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    return d


def test_train_resume_and_use(tiny, inputs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    common = [
        "--out",
        str(out),
        "--corpus",
        str(inputs / "corpus.txt"),
        "--prompts",
        str(inputs / "prompts.jsonl"),
        "--eval-every",
        "10",
    ]
    train(monkeypatch, capsys, *common, "--steps", "10")
    log = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10]
    res = train(monkeypatch, capsys, *common, "--steps", "20", "--resume")
    assert "resumed at step 10" in res.err and "after 20 steps" in res.out
    log = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20] and all(r["tau"]["dominotree"] >= 1 for r in log)

    # both checkpoints load with the released-layout loaders and pair with the target
    target = load_target(tiny.target)
    dflash, domino = load_drafter(out / "dflash"), load_drafter(out / "domino")
    assert dflash.head is None and domino.head is not None and domino.cfg.block_size == 6
    check_pair(target, domino, out / "domino")
    # and generate exactly the AR tokens
    pair = Pair(tiny.target, out / "dflash", out / "domino")
    ids = pipe_for(pair, spec("ar")).tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    ar = pipe_for(pair, spec("ar")).generate(ids, 24, SamplingConfig()).tokens
    for method in ("dflash", "dominotree"):
        assert pipe_for(pair, spec(method)).generate(ids, 24, SamplingConfig()).tokens == ar


def test_refuses_to_overwrite_and_bad_inputs(inputs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "x").write_text("")
    monkeypatch.setattr(sys, "argv", ["dtrt", "train-drafter", "--model", "tiny", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "dtrt",
            "train-drafter",
            "--model",
            "tiny",
            "--out",
            str(tmp_path / "new"),
            "--prompts",
            str(tmp_path / "missing.jsonl"),
        ],
    )
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "missing.jsonl: not found" in err and err.count("\n") == 1


def test_init_from_a_missing_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    out, missing = tmp_path / "run", tmp_path / "missing"
    argv = ["dtrt", "train-drafter", "--model", "tiny", "--out", str(out), "--init-from", str(missing)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{missing / 'config.json'}: not found" in err and err.count("\n") == 1
    assert not (out / ".train" / "data").exists()


def test_batched_continuations_equal_ar(tiny):
    """The batched, left-padded greedy decoder that makes training data gives each prompt's AR tokens, and a
    row stops at a stop token."""
    from dtrt.train.data import batched_greedy, continuations

    pipe = pipe_for(tiny, spec("ar"))
    ids = [pipe.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:5]]
    assert len(set(map(len, ids))) > 1  # padding is exercised
    target = pipe.backend.target
    batched = batched_greedy(target, ids, 20)
    for p, got in zip(ids, batched):
        assert got == pipe.generate(p, 20, SamplingConfig()).tokens
    stop = batched[0][5]
    rows, lengths = continuations(target, ids[:1], 20, 64, stop=(stop,))
    first = batched[0].index(stop)
    assert lengths.tolist() == [len(ids[0]) + first + 1]
    assert rows[0, : lengths[0]].tolist() == ids[0] + batched[0][: first + 1]


def test_held_out_sets_are_each_measured_and_reported(tiny, inputs, tmp_path, monkeypatch, capsys):
    """--held-out takes bench datasets and files, repeated: tau per set in the log, the best by their mean."""
    (tmp_path / "mine.txt").write_text("\n".join(PROMPTS[:3]))
    out = tmp_path / "run"
    res = train(
        monkeypatch,
        capsys,
        *("--out", str(out), "--corpus", str(inputs / "corpus.txt"), "--steps", "2", "--eval-every", "2"),
        *("--held-out", "mt-bench", "--held-out", str(tmp_path / "mine.txt")),
    )
    (record,) = [json.loads(line) for line in (out / ".train" / "log.jsonl").read_text().splitlines()]
    sets = record["tau"]["sets"]
    assert list(sets) == ["mt-bench", "mine"]
    for name in ("dominotree", "dflash"):
        assert record["tau"][name] == pytest.approx((sets["mt-bench"][name] + sets["mine"][name]) / 2)
    assert "; mt-bench " in res.err and "; mine " in res.err


def test_held_out_dataset_prompts_are_the_bench_first_turns(tiny):
    from dtrt.bench import datasets
    from dtrt.bench.datasets import held_out_set
    from dtrt.frontend.prompts import as_chat

    name, texts = held_out_set("humaneval", tiny.target, True, 3)
    want = [p.turns[0] for p in datasets.load("humaneval", 3, seed=0)]
    assert name == "humaneval" and texts == as_chat(want, tiny.target, True) and len(texts) == 3
    assert held_out_set("mt-bench", tiny.target, False, 2)[1] == [p.turns[0] for p in datasets.load("mt-bench", 2)]


@pytest.mark.parametrize(
    "sets, message",
    [
        (["lexsum"], "--held-out lexsum: a long-context dataset"),
        (["nothere.jsonl"], "--held-out nothere.jsonl: not found"),
        (["mt-bench", "mt-bench"], "--held-out mt-bench: a second set named 'mt-bench'"),
        (["EMPTY"], "empty.txt: holds no prompts"),
    ],
)
def test_bad_held_out_sets(inputs, tmp_path, monkeypatch, capsys, sets, message):
    (tmp_path / "empty.txt").write_text("\n")
    sets = [str(tmp_path / "empty.txt") if s == "EMPTY" else s for s in sets]
    args = [a for s in sets for a in ("--held-out", s)]
    monkeypatch.setattr(sys, "argv", ["dtrt", "train-drafter", "--model", "tiny", "--out", str(tmp_path / "r"), *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()

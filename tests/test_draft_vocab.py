"""A reduced draft vocabulary (`dtrt draft-vocab`, `--draft-vocab`): the file's EAGLE-3 layout and its checks, the
drafter's head over the subset, every method giving AR's tokens at T=0 with drafts accepted on torch and ONNX Runtime
(fp32, int8 and int4 drafter stages), T=1 output following the target's distribution when the target often picks a token
outside the subset, and the one-line errors."""

import json

import pytest
import torch
from helpers import PROMPTS, drafter_quant_export, generate_all, pipe_for, run_cli, spec
from safetensors.torch import load_file, save_file
from test_bad_input import expect_error
from test_methods import LINEAR_COST
from test_sampling import N, chi_square_pvalue, exact_triples, sample

from dtrt.errors import DtrtError
from dtrt.exporter.export_config import ExportConfig
from dtrt.exporter.write import export_pair
from dtrt.models.draft_vocab import FILE, DraftHead, DraftVocab, load_draft_vocab, resolve_draft_vocab
from dtrt.train.config import DataGenConfig
from dtrt.train.datagen import drafter_data
from dtrt.train.draft_vocab import choose
from dtrt.tree import Round, build_ddtree, build_heap

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["dflash", "domino", "ddtree", "caddtree", "dominotree", "cadominotree"]
V = 128  # the tiny pair's vocabulary


@pytest.fixture(scope="module")
def ar(tiny):
    return generate_all(pipe_for(tiny, spec("ar")))


@pytest.fixture(scope="module")
def subset(ar, tmp_path_factory):
    """80 of the 128 tokens: every token AR writes (so drafts can be accepted), EOS, and the lowest others; 48
    tokens are never drafted."""
    used = {t for g in ar for t in g.tokens} | {0}
    ids = sorted(used | set(range(V)[: 80 - len(used)]))
    ids = (ids + [i for i in range(V) if i not in ids])[:80]
    path = tmp_path_factory.mktemp("vocab") / FILE
    DraftVocab.from_ids(ids, V).save(path)
    return path


def test_file_layout_round_trip(tmp_path):
    vocab = DraftVocab.from_ids([5, 0, 9, 9, 100], V)
    assert vocab.ids.tolist() == [0, 5, 9, 100]
    vocab.save(tmp_path / FILE, {"coverage": 0.5})
    t = load_file(tmp_path / FILE)
    assert t["d2t"].tolist() == [0, 4, 7, 97]  # EAGLE-3: target id = draft id + d2t[draft id]
    assert t["t2d"].dtype == torch.bool and t["t2d"].nonzero().flatten().tolist() == [0, 5, 9, 100]
    back = load_draft_vocab(tmp_path / FILE, V, must_hold=[0])
    assert torch.equal(back.ids, vocab.ids) and back.sha256 == vocab.sha256
    save_file({"d2t": t["d2t"]}, str(tmp_path / "eagle.safetensors"))  # a released file: d2t alone, no metadata
    assert torch.equal(load_draft_vocab(tmp_path / "eagle.safetensors", V).ids, vocab.ids)


def test_the_file_is_the_same_bytes_from_every_process(tmp_path):
    """safetensors writes its metadata in a hash map's order, which changes from process to process: the header is
    written sorted, so an export's copy of the subset is the same bytes each time it is made."""
    import subprocess
    import sys

    from safetensors.torch import save

    from dtrt.models.draft_vocab import sorted_header

    script = "import sys; from dtrt.models.draft_vocab import DraftVocab as V; V.from_ids(range(0, 90, 3), 128)"
    script += ".save(sys.argv[1], {'b': 1, 'a': 2})"
    paths = [tmp_path / f"{i}.safetensors" for i in range(4)]
    for path in paths:
        subprocess.run([sys.executable, "-c", script, str(path)], check=True)
    assert len({p.read_bytes() for p in paths}) == 1
    data = save({"x": torch.arange(3)}, metadata={"z": "1", "a": "2"})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    backwards = json.dumps(dict(reversed(header.items())), separators=(",", ":")).encode().ljust(n)
    out = sorted_header(data[:8] + backwards + data[8 + n :])
    back = json.loads(out[8 : 8 + n])
    assert len(out) == len(data) and back == header and list(back) == sorted(header)
    assert list(back["__metadata__"]) == ["a", "z"]
    (tmp_path / "sorted.safetensors").write_bytes(out)
    assert torch.equal(load_file(tmp_path / "sorted.safetensors")["x"], torch.arange(3))


def test_resolve(tmp_path):
    (tmp_path / "drafter").mkdir()
    assert resolve_draft_vocab(None, tmp_path / "drafter", V) is None  # no file of its own: the whole vocabulary
    DraftVocab.from_ids(range(70), V).save(tmp_path / "drafter" / FILE)
    assert resolve_draft_vocab(None, tmp_path / "drafter", V).size == 70
    assert resolve_draft_vocab("auto", tmp_path / "drafter", V).size == 70
    assert resolve_draft_vocab("full", tmp_path / "drafter", V) is None


@pytest.mark.parametrize(
    "tensors, meta, vocab, fragment",
    [
        ({"d2t": torch.zeros(3, dtype=torch.long)}, None, 64, "made for a vocabulary of 128"),
        ({"d2t": torch.tensor([0, 0, -1])}, None, V, "ascending ids"),
        ({"t2d": torch.zeros(V, dtype=torch.bool)}, None, V, "holds no d2t"),
        ({"d2t": torch.tensor([0, 1, 2])}, {"tokenizer_sha256": "0" * 64}, V, "another tokenizer"),
        ({"d2t": torch.tensor([1, 1, 1])}, None, V, "lacks the EOS id(s) [0]"),
    ],
)
def test_bad_files(tmp_path, tensors, meta, vocab, fragment):
    if "d2t" in tensors and "t2d" not in tensors and fragment.startswith("made"):
        tensors["t2d"] = torch.zeros(V, dtype=torch.bool)
    path = tmp_path / FILE
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)} if meta else None)
    with pytest.raises(DtrtError, match="draft-vocab|d2t|vocabulary|tokenizer|EOS") as e:
        load_draft_vocab(path, vocab, must_hold=[0], tokenizer_sha256="1" * 64)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_head_covers_the_subset_only(tiny):
    lm_head = pipe_for(tiny, spec("ar")).backend.target.lm_head
    vocab = DraftVocab.from_ids([0, 3, 7, 64, 127], V)
    ph = torch.randn(3, lm_head.weight.shape[1])
    head = DraftHead(lm_head, vocab)
    logits, full = head(ph), DraftHead(lm_head)(ph)
    assert logits.shape == (3, vocab.size) and full.shape == (3, V)
    torch.testing.assert_close(logits, full[:, vocab.ids])
    base = Round(ph[None], logits[None], torch.tensor([0]), *head.columns()).base[0]  # the full row, on demand
    assert torch.equal(base[:, vocab.ids], logits)
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab.ids] = False
    assert torch.isneginf(base[:, outside]).all()


@pytest.mark.parametrize("builder", ["marginal", "ddtree", "dominotree"])
def test_columns_build_the_trees_of_the_scattered_rows(tiny, builder):
    """The builders over a round's subset columns (the block's output) give the trees they gave over the same logits
    scattered into the whole vocabulary (what the block returned before): tokens, parents and scores alike."""
    backend = pipe_for(tiny, spec("dominotree")).backend
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(V, generator=g)[:40].sort().values
    D, H = backend.drafter.cfg.k_draft, backend.drafter.cfg.hidden_size
    ph, logits, root = torch.randn(1, D, H, generator=g), 3 * torch.randn(1, D, 40, generator=g), torch.tensor([5])
    columns = Round(ph, logits, root, ids, V)
    scattered = Round(ph, columns.base.clone(), root)
    for budget in (1, 2, 6, 12):
        trees = []
        for rnd in (columns, scattered):
            if builder == "ddtree":
                lp = torch.log_softmax(rnd.logits[0], dim=-1)
                trees.append(build_ddtree(lp, budget, root=5, ids=rnd.ids))
            else:
                arm = "marg" if builder == "marginal" else "dominotree"
                trees.append(build_heap(backend.scorer(arm, rnd, 3, 16), budget, D))
        a, b = trees
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert set(a.tokens[1:].tolist()) <= set(ids.tolist())
        torch.testing.assert_close(a.scores, b.scores)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_ar_with_drafts_accepted(tiny, ar, subset, method):
    pipe = pipe_for(tiny, spec(method, draft_vocab=str(subset)))
    if method.startswith("ca"):  # a fixed cost curve: a measured one varies with load
        pipe.method.curve = LINEAR_COST
    gens = generate_all(pipe)
    assert [g.tokens for g in gens] == [g.tokens for g in ar]
    assert sum(g.tau for g in gens) / len(gens) > 2  # drafts were accepted
    assert len({r.accepted for g in gens for r in g.rounds}) >= 3  # full, partial and zero acceptance alike


def test_drafts_never_leave_the_subset(tiny, subset):
    pipe = pipe_for(tiny, spec("dominotree", draft_vocab=str(subset)))
    held = set(load_draft_vocab(subset, V).ids.tolist())
    drafted = []
    orig = pipe.backend.target_forward

    def spy(ids, positions, mask):
        if int(positions[0]) > 0:  # a tree (not the prompt's prefill): its nodes after the committed root
            drafted.extend(ids[1:].tolist())
        return orig(ids, positions, mask)

    pipe.backend.target_forward = spy
    generate_all(pipe, 24)
    assert drafted and set(drafted) <= held


@pytest.fixture(scope="module")
def exported(tiny, subset, tmp_path_factory):
    """The pair exported over the subset, and copies with its drafter stages quantized as `--drafter-quant` does."""
    root = tmp_path_factory.mktemp("export")
    full = export_pair(tiny, root / "none", ExportConfig(max_context=512, draft_vocab=str(subset)), model="tiny")
    return {"none": full, **{q: drafter_quant_export(full, tmp_path_factory, q) for q in ("int8", "int4")}}


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("method", ["dflash", "ddtree", "dominotree"])
def test_onnxruntime_is_ar_with_drafts_accepted(tiny, ar, exported, quant, method):
    exp = exported[quant]
    assert exp.drafters["domino"]["draft_vocab"]["size"] == 80
    gens = generate_all(pipe_for(tiny, spec(method), backend="onnxruntime", export=exp.path))
    assert [g.tokens for g in gens] == [g.tokens for g in ar]
    assert sum(g.tau for g in gens) / len(gens) > 2


def test_export_block_equals_the_torch_block(tiny, exported, subset):
    """The exported block stage's base logits are the torch backend's, over the subset's 80 columns alike, and both
    backends name the same ids for them."""
    torch_pipe = pipe_for(tiny, spec("dominotree", draft_vocab=str(subset)))
    ort_pipe = pipe_for(tiny, spec("dominotree"), backend="onnxruntime", export=exported["none"].path)
    ids = torch_pipe.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    outs = []
    for p in (torch_pipe, ort_pipe):
        b = p.backend
        b.reset(64)
        logits, hidden = b.target_forward(
            torch.tensor(ids), torch.arange(len(ids)), torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        )
        b.commit(torch.arange(len(ids)))
        b.draft_context(hidden, torch.arange(len(ids)))
        outs.append(b.draft_block(int(logits[-1].argmax()), len(ids), rows=3)[1].cpu())
        columns, vocab_size = b.draft_columns()
        assert columns.tolist() == load_draft_vocab(subset, V).ids.tolist() and vocab_size == V
    assert outs[0].shape == outs[1].shape == (3, 80)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_a_block_of_another_width_is_refused(tiny, exported, tmp_path):
    """An export whose manifest says its block covers the subset, but whose block returns another width (a manifest
    edited by hand, a stage swapped), is refused in one line naming the re-export rather than mapping the wrong ids."""
    import shutil

    path = tmp_path / "exp"
    shutil.copytree(exported["none"].path, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["layout"] = 14  # an export of layout 14 scattered its rows into the whole vocabulary
    (path / "manifest.json").write_text(json.dumps(manifest))
    pipe = pipe_for(tiny, spec("dominotree"), backend="onnxruntime", export=path)
    with pytest.raises(DtrtError, match="block stage returns 80 columns") as e:
        generate_all(pipe, 8)
    assert "\n" not in str(e.value) and "dtrt export" in str(e.value)


def test_export_and_run_refuse_another_vocabulary(tiny, exported, tmp_path):
    exp = exported["none"]
    with pytest.raises(DtrtError, match="--draft-vocab full: .* drafts from a 80-token subset") as e:
        pipe_for(tiny, spec("dominotree", draft_vocab="full"), backend="onnxruntime", export=exp.path)
    assert "--draft-vocab full" in str(e.value).split("re-export with")[1]
    other = tmp_path / "other.safetensors"
    DraftVocab.from_ids(range(90), V).save(other)
    with pytest.raises(DtrtError, match="another subset"):
        pipe_for(tiny, spec("dominotree", draft_vocab=str(other)), backend="onnxruntime", export=exp.path)
    small = tmp_path / "small.safetensors"
    DraftVocab.from_ids(range(16), V).save(small)
    with pytest.raises(DtrtError, match="16 tokens, fewer than --topm 64"):
        pipe_for(tiny, spec("dominotree", draft_vocab=str(small)))
    with pytest.raises(DtrtError, match="16 tokens, fewer than --topm 64"):
        export_pair(tiny, tmp_path / "x", ExportConfig(draft_vocab=str(small)), model="tiny")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_t1_follows_the_target_with_tokens_outside_the_subset(tiny, tmp_path):
    """At T=1 with a subset that misses much of the target's mass, committed tokens still follow the target's
    distribution: the residual max(0, p - q) carries the tokens the drafter can never propose."""
    pipe_ar = pipe_for(tiny, spec("ar"))
    prompt = PROMPTS[3]
    ids = pipe_ar.tokenizer.encode(prompt, add_special_tokens=False)
    dist = exact_triples(pipe_ar.backend.target, ids, 1.0)
    first = {}
    for (a, _, _), p in dist.items():
        first[a] = first.get(a, 0.0) + p
    # the subset: the likelier half of the first token's mass and 8 of the other tokens
    ranked = sorted(first, key=first.get, reverse=True)
    kept, mass = [], 0.0
    for t in ranked:
        if mass >= 0.5:
            break
        kept.append(t)
        mass += first[t]
    ids_subset = sorted(set(kept) | {0} | set([i for i in range(V) if i not in first][:8]))
    f = tmp_path / FILE
    DraftVocab.from_ids(ids_subset, V).save(f)
    pipe = pipe_for(tiny, spec("dominotree", draft_vocab=str(f), topm=8))
    counts, accepted = sample(pipe, ids)
    outside = sum(n for (a, *_), n in counts.items() if a not in set(ids_subset))
    assert outside >= N // 5, outside  # the target often picked a token the drafter cannot propose
    assert accepted >= N // 10, accepted  # ... and drafts were accepted
    assert chi_square_pvalue(counts, dist, N) > 1e-3
    assert chi_square_pvalue(counts, exact_triples(pipe_ar.backend.target, ids, 2.0), N) < 1e-3


def test_choose_keeps_the_always_kept_and_breaks_ties_by_id():
    counts = torch.tensor([0, 5, 5, 9, 0, 1, 5, 0])
    assert choose(counts, 4, {7}).tolist() == [1, 2, 3, 7]
    with pytest.raises(DtrtError, match="always kept"):
        choose(counts, 1, {0, 7})


def test_draft_vocab_command(tiny, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = DataGenConfig(samples=2, max_new_tokens=24, shard_rows=4, batch=4)
    drafter_data(tiny.target, data, cfg, str(tmp_path / "prompts.jsonl"), (), name="tiny", log=lambda m: None)
    out = tmp_path / "vocab" / FILE
    code, stdout, err = run_cli(
        monkeypatch, capsys, "draft-vocab", "--model", "tiny", "--data", str(data), "--size", "72", "--out", str(out)
    )
    assert code == 0, err
    assert f"{out}: 72 of 128 tokens" in stdout and "answer tokens" in stdout
    vocab = load_draft_vocab(out, V, must_hold=[0])
    answers = torch.cat([torch.tensor(r) for r in answer_rows(data, tiny)])
    assert set(answers.unique().tolist()) <= set(vocab.ids.tolist())  # 72 covers every answer token of this data
    gens = generate_all(pipe_for(tiny, spec("dominotree", draft_vocab=str(out))))
    assert sum(g.tau for g in gens) / len(gens) > 2
    again = ["draft-vocab", "--model", "tiny", "--size", "72", "--data"]
    expect_error(monkeypatch, capsys, *again, str(data), "--out", str(out), fragments=["already exists; pass --force"])
    expect_error(
        monkeypatch, capsys, *again, str(tmp_path), "--out", str(tmp_path / "x"), fragments=["no progress.json"]
    )
    missing = str(tmp_path / "missing.safetensors")
    run = ["run", "--model", "tiny", "--backend", "torch", "--draft-vocab", missing, "hi"]
    expect_error(monkeypatch, capsys, *run, fragments=["no such file"])


def answer_rows(data, tiny):
    from dtrt.train.datagen import load_rows

    rows, _ = load_rows(data, tiny.target)
    return [r.tokens[r.response_start :] for r in rows if r.prompt >= 0]


def test_bench_rows_take_the_draft_vocab(subset):
    from dtrt.bench import contenders
    from dtrt.bench.main import BenchOptions

    o = BenchOptions(model="tiny", backend="torch", draft_vocab=str(subset))
    grid = contenders.grid(o.sources, ["dflash", "dominotree"], [None], [None])
    assert [s.method for s in grid] == ["ar", "dflash", "dominotree"]
    assert all(s.draft_vocab == str(subset) for s in grid)

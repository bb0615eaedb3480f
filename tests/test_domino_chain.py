"""The domino method is Domino's own chain: the corrected argmax over the full vocabulary at every depth (not
restricted to the base top-M candidates, which --topm sets for the tree builders), on torch and on ONNX Runtime."""

import onnxruntime as ort
import pytest
import torch
from helpers import drafter_json, write_drafter

from dtrt.exporter.onnx_export import export_stage
from dtrt.exporter.scorer_stages import scorer_stages
from dtrt.models.checkpoint import load_drafter, load_target
from dtrt.scoring import DominoScorer, domino_chain, greedy_chain_tables
from dtrt.tree import Round

M = 8


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    target = load_target(tiny.target)
    cfg = drafter_json(hidden=target.cfg.hidden_size, vocab=target.cfg.vocab_size, block=6, domino=True)
    drafter = load_drafter(write_drafter(tmp_path_factory.mktemp("d") / "domino", cfg, gru=16, emb=24))
    return target, drafter


@torch.no_grad()
def round_outside_the_top_m(target, drafter, seed=0):
    """A round whose corrected argmax at depth 1 is a token ranked last by the base logits (far outside the top M),
    made so by the correction head's output row for that token."""
    head, embed, cfg = drafter.head, target.model.embed_tokens, drafter.cfg
    g = torch.Generator().manual_seed(seed)
    D, H, V = cfg.k_draft, cfg.hidden_size, cfg.vocab_size
    rnd = Round(torch.randn(1, D, H, generator=g), 2 * torch.randn(1, D, V, generator=g), torch.tensor([3]))
    sc = DominoScorer(rnd, head, embed, 1, 0, cfg.pure_draft_prefix_len)
    s0 = sc.root_states()[:, None]
    t0 = rnd.base[0, 0].argmax()  # depth 0: the base marginal (prefix_len 1)
    h1 = sc.bottleneck(sc.advance(s0, t0.view(1, 1)), 1)[0, 0]
    x = int(rnd.base[0, 1].argmin())
    head.embed_proj[2].weight[x] += 1e3 * h1 / h1.dot(h1)  # W2[x] . h1 grows by 1000
    return rnd, x


def test_the_chain_takes_the_whole_vocabulary(models):
    target, drafter = models
    rnd, x = round_outside_the_top_m(target, drafter)
    head, embed, p = drafter.head, target.model.embed_tokens, drafter.cfg.pure_draft_prefix_len
    chain = domino_chain(rnd, head, embed, p)[0]
    assert int(chain[1]) == x
    top_m = greedy_chain_tables(DominoScorer(rnd, head, embed, 1, M, p))[0][0, :, 0]
    assert int(top_m[1]) != x, "the restricted chain cannot reach a token outside the base top-M"
    full = greedy_chain_tables(DominoScorer(rnd, head, embed, 1, 0, p))[0][0, :, 0]
    assert torch.equal(chain, full)


def test_the_exported_chain_stage_is_the_torch_chain(models, tmp_path):
    target, drafter = models
    rnd, x = round_outside_the_top_m(target, drafter, seed=1)
    stage = next(s for s in scorer_stages(target, drafter, 8, M, 4) if s.name == "chain")
    export_stage(stage, tmp_path / "chain.onnx", 64, 64)
    sess = ort.InferenceSession(str(tmp_path / "chain.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"ph": rnd.ph[0].numpy(), "base": rnd.base[0].numpy(), "root": rnd.root.numpy()})
    want = domino_chain(rnd, drafter.head, target.model.embed_tokens, drafter.cfg.pure_draft_prefix_len)[0]
    assert got.tolist() == want.tolist() and int(got[1]) == x

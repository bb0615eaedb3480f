"""Hybrid Gated-DeltaNet targets: the reference against transformers' Qwen3NextForCausalLM, tree-aware recurrent
verification (per-node states equal re-running every root-to-node path), every method exact to AR on the tiny hybrid
pair on torch and ONNX Runtime with drafts accepted, the flattened-tree negative control drifting, and parity."""

import json

import numpy as np
import onnx
import pytest
import torch
from helpers import pipe_for, run_cli, spec
from onnx import TensorProto
from test_export_scorer import single_node_session
from test_methods import LINEAR_COST
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from dtrt.models.checkpoint import load_target
from dtrt.models.hybrid import HybridTarget, tree_parents
from dtrt.ops.tree_causal_conv1d import tree_causal_conv1d_ref
from dtrt.ops.tree_gated_delta_net import chunk_gated_delta_rule, tree_gated_delta_net_ref
from dtrt.parity.check import run_parity
from dtrt.runtime.sampling import SamplingConfig
from dtrt.tree import Tree
from dtrt.zoo.registry import tiny_hybrid_pair

PROMPTS = ["The cat sees ", "Every king walks ", "Some old man reads "]
MAX_NEW = 48
VARIANTS = [
    spec("dflash"),
    spec("domino"),
    spec("ddtree"),
    spec("caddtree", budget=32),
    spec("dominotree"),
    spec("dominotree", builder="frontier"),
    spec("dominotree", arm="condstatic"),
]
# a tree with fan-out at several depths, deeper than the conv kernel (node 11 sits at depth 6)
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 0, 7, 9, 10]


def ids(d) -> str:
    return f"{d.method}-{d.builder}-{d.arm}-b{d.budget}"


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


# the reference against transformers, on random weights


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    torch.manual_seed(1)
    cfg = Qwen3NextConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        num_experts=0,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    hf = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # the norms start at zero offset and dt_bias at one: make them count
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    ours = load_target(path)
    assert isinstance(ours, HybridTarget)
    return hf, ours


@torch.no_grad()
def test_prefill_tree_verify_and_commit_match_transformers(hf_pair):
    hf, ours = hf_pair
    prompt = torch.randint(0, 100, (11,))
    ref = hf(prompt[None], output_hidden_states=True)
    cache = ours.new_cache(64)
    logits, taps = ours(prompt, torch.arange(11), causal(11), cache, taps=(0, 2))
    assert (logits - ref.logits[0]).abs().max() < 1e-5
    assert (taps[:, :64] - ref.hidden_states[1][0]).abs().max() < 1e-5
    assert (taps[:, 64:] - ref.hidden_states[3][0]).abs().max() < 1e-5
    cache.commit(torch.arange(11))
    tree = Tree.from_parents(torch.randint(0, 100, (len(PARENTS),)), PARENTS)
    logits, _ = ours(tree.tokens, tree.positions(11), tree.mask, cache)
    for i in range(len(tree)):
        path = tree.mask[i].nonzero()[:, 0]
        want = hf(torch.cat((prompt, tree.tokens[path]))[None]).logits[0, -1]
        assert (logits[i] - want).abs().max() < 1e-5, i
    accepted = [0, 2, 5, 7, 9]  # then one decode step from the committed recurrent state and conv window
    cache.commit(accepted)
    step, _ = ours(torch.tensor([42]), torch.tensor([16]), causal(1), cache)
    want = hf(torch.cat((prompt, tree.tokens[accepted], torch.tensor([42])))[None]).logits[0, -1]
    assert (step[0] - want).abs().max() < 1e-5


@torch.no_grad()
def test_per_node_states_equal_sequential_paths(hf_pair):
    _, ours = hf_pair
    prompt = torch.randint(0, 100, (6,))
    tree = Tree.from_parents(torch.randint(0, 100, (len(PARENTS),)), PARENTS)

    def prefilled():
        cache = ours.new_cache(64)
        ours(prompt, torch.arange(6), causal(6), cache)
        cache.commit(torch.arange(6))
        return cache

    cache = prefilled()
    ours(tree.tokens, tree.positions(6), tree.mask, cache)
    assert torch.equal(tree_parents(tree.mask), tree.parents)
    for i in range(len(tree)):
        seq = prefilled()  # the root-to-node path, one token per forward
        for depth, j in enumerate(tree.mask[i].nonzero()[:, 0].tolist()):
            ours(tree.tokens[j : j + 1], torch.tensor([6 + depth]), causal(1), seq)
            seq.commit([0])
        for layer in range(len(seq.node_states)):
            assert (cache.node_states[layer][i] - seq.state[layer]).abs().max() < 1e-6, (i, layer)
            assert (cache.node_windows[layer][i] - seq.conv[layer]).abs().max() < 1e-6, (i, layer)


def random_recurrence(n, heads=3, dk=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=g), dim=-1)
    return (
        q,
        k,
        torch.randn(n, heads, dv, generator=g),
        -torch.rand(n, heads, generator=g),
        torch.rand(n, heads, generator=g),
        torch.randn(heads, dk, dv, generator=g),
    )


def test_op_function_bodies_match_the_references():
    """The ONNX function bodies ONNX Runtime runs, on a tree and on a forest (several nodes on the committed state)."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    gdn = single_node_session(
        "TreeGatedDeltaNet",
        [(n, f32) for n in ("q", "k", "v", "g", "beta")] + [("parents", i64), ("state0", f32)],
        [("out", f32), ("states", f32)],
    )
    conv = single_node_session(
        "TreeCausalConv1d",
        [("x", f32), ("parents", i64), ("conv_state", f32), ("weight", f32)],
        [("out", f32), ("windows", f32)],
    )
    g = torch.Generator().manual_seed(0)
    for parents in (PARENTS, [-1, 0, -1, 2, 1, -1]):
        parents = torch.tensor(parents)
        q, k, v, decay, beta, state0 = random_recurrence(len(parents))
        got = gdn.run(
            None,
            {
                "q": q.numpy(),
                "k": k.numpy(),
                "v": v.numpy(),
                "g": decay.numpy(),
                "beta": beta.numpy(),
                "parents": parents.numpy(),
                "state0": state0.numpy(),
            },
        )
        for a, b in zip(got, tree_gated_delta_net_ref(q, k, v, decay, beta, parents, state0)):
            assert np.allclose(a, b.numpy(), atol=1e-6, rtol=0)
        x, state, weight = (
            torch.randn(len(parents), 6, generator=g),
            torch.randn(6, 3, generator=g),
            torch.randn(6, 4, generator=g),
        )
        got = conv.run(
            None, {"x": x.numpy(), "parents": parents.numpy(), "conv_state": state.numpy(), "weight": weight.numpy()}
        )
        for a, b in zip(got, tree_causal_conv1d_ref(x, parents, state, weight)):
            assert np.allclose(a, b.numpy(), atol=1e-6, rtol=0)


def test_training_path_is_the_recurrence():
    """Training runs plain sequences through a padded conv and the chunked rule; they equal the tree ops on a chain."""
    q, k, v, decay, beta, _ = random_recurrence(40)
    chain = torch.arange(40) - 1
    out, _ = tree_gated_delta_net_ref(q, k, v, decay, beta, chain, torch.zeros(3, 8, 5))
    assert (chunk_gated_delta_rule(q, k, v, decay, beta) - out).abs().max() < 1e-5
    x, weight = torch.randn(40, 6), torch.randn(6, 4)
    conv, _ = tree_causal_conv1d_ref(x, chain, torch.zeros(6, 3), weight)
    padded = torch.nn.functional.conv1d(torch.nn.functional.pad(x.T, (3, 0)), weight[:, None], groups=6).T
    assert (conv - torch.nn.functional.silu(padded)).abs().max() < 1e-5


def test_config_errors(tmp_path, monkeypatch, capsys):
    cfg = Qwen3NextConfig(num_hidden_layers=2).to_dict()  # transformers' default: sparse MoE MLPs
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--target", str(tmp_path), "--method", "ar", "x")
    assert code == 2 and err.startswith("error: ") and "sparse MoE" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_experts": 0, "layer_types": ["full_attention"]}))
    code, out, err = run_cli(monkeypatch, capsys, "run", "--target", str(tmp_path), "--method", "ar", "x")
    assert code == 2 and "layer_types must list 2 entries" in err


# the tiny hybrid pair: every method, both backends, the negative control, parity


@pytest.fixture(scope="module")
def pair():
    return tiny_hybrid_pair()


@pytest.fixture(scope="module")
def export(pair, tmp_path_factory):
    from dtrt.exporter.export_config import ExportConfig
    from dtrt.exporter.write import export_pair

    return export_pair(
        pair, tmp_path_factory.mktemp("export") / "tiny-hybrid", ExportConfig(max_context=256), model="tiny-hybrid"
    )


def pipeline(pair, export, draft, backend):
    if backend == "torch":
        return pipe_for(pair, draft)
    return pipe_for(None, draft, backend="onnxruntime", export=export.path, threads=1)


def generate(pipe, flatten_tree=False):
    target = pipe.backend.target if pipe.backend.name == "torch" else pipe.backend
    target.flatten_tree = flatten_tree
    if pipe.spec.method == "caddtree":  # a fixed cost curve: a measured one varies with machine load
        pipe.method.curve = LINEAR_COST
    return [
        pipe.generate(pipe.tokenizer.encode(p, add_special_tokens=False), MAX_NEW, SamplingConfig()) for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def ar_tokens(pair):
    return [g.tokens for g in generate(pipe_for(pair, spec("ar")))]


def prefix_agreement(gens, ar_tokens):
    """Tokens equal to AR's before the first difference, per prompt."""
    return [
        next((i for i, (a, b) in enumerate(zip(g.tokens, want)) if a != b), len(want))
        for g, want in zip(gens, ar_tokens)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_every_method_gives_the_ar_tokens_with_drafts_accepted(pair, export, ar_tokens, backend):
    assert [g.tokens for g in generate(pipeline(pair, export, spec("ar"), backend))] == ar_tokens
    for draft in VARIANTS:
        gens = generate(pipeline(pair, export, draft, backend))
        assert [g.tokens for g in gens] == ar_tokens, ids(draft)
        rounds = [r for g in gens for r in g.rounds]
        assert sum(r.accepted for r in rounds) / len(rounds) > 2, ids(draft)
        assert max(r.tree_size for r in rounds) > 1 and all(r.tree_size <= draft.budget + 1 for r in rounds)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_flattened_tree_negative_control_drifts(pair, export, ar_tokens, backend):
    """Updating the recurrent state as if the tree were one chain lets rejected siblings into the accepted path's
    state: the text leaves AR's within the first rounds, while tree-aware verification never does."""
    for draft in (spec("ddtree"), spec("dominotree")):
        pipe = pipeline(pair, export, draft, backend)
        tree_aware = prefix_agreement(generate(pipe), ar_tokens)
        flattened = prefix_agreement(generate(pipe, flatten_tree=True), ar_tokens)
        assert tree_aware == [MAX_NEW] * len(PROMPTS), ids(draft)
        assert sum(flattened) < sum(tree_aware) / 4, (ids(draft), flattened)
    chain = pipeline(pair, export, spec("dflash"), backend)  # a chain has no siblings: nothing to flatten
    assert prefix_agreement(generate(chain, flatten_tree=True), ar_tokens) == [MAX_NEW] * len(PROMPTS)


@pytest.mark.slow
def test_export_has_the_recurrent_dtrt_ops(export):
    m = onnx.load(str(export.stage("target")), load_external_data=False)
    ops = [n.op_type for n in m.graph.node if n.domain == "dtrt"]
    assert ops.count("TreeGatedDeltaNet") == ops.count("TreeCausalConv1d") == 3 and ops.count("TreeAttention") == 1
    assert {(f.domain, f.name) for f in m.functions} == {
        ("dtrt", n) for n in ("TreeAttention", "TreeCausalConv1d", "TreeGatedDeltaNet")
    }
    meta = export.manifest
    assert meta["stages"]["target"]["inputs"][-2:] == ["state", "conv"]
    assert meta["stages"]["target"]["outputs"][-2:] == ["states", "windows"]
    assert meta["target"]["kv_layers"] == 1 and meta["target"]["recurrent_layers"] == 3


@pytest.mark.slow
def test_parity_covers_the_recurrent_states(export):
    report = run_parity(export, prompts=2)
    assert report.ok, report.table()
    rows = [r for r in report.rows if r.stage == "target"]
    assert {r.output for r in rows} >= {"states", "windows"} and any(r.case.startswith("real") for r in rows)
    assert all(r.rel <= 1e-4 for r in rows)


@pytest.mark.slow
def test_cli_runs_the_hybrid_on_both_backends(pair, export, ar_tokens, monkeypatch, capsys):
    for extra in ([], ["--backend", "onnxruntime", "--export", str(export.path)]):
        code, out, err = run_cli(
            monkeypatch,
            capsys,
            "run",
            "--model",
            "tiny-hybrid",
            "--json",
            "--max-new-tokens",
            str(MAX_NEW),
            *extra,
            PROMPTS[0],
        )
        assert code == 0, err
        res = json.loads(out)
        assert res["tokens"] == ar_tokens[0] and res["tau"] > 2


def test_train_drafter_refuses_a_hybrid_target_in_one_line(pair, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(monkeypatch, capsys, "train-drafter", "--target", str(pair.target), "--out", str(out))
    assert code == 2 and "hybrid Gated-DeltaNet targets are not supported" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()

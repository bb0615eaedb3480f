"""`tiny-hybrid`: tiny's recipe for a hybrid target. A character-level Qwen3-Next (three Gated-DeltaNet layers, then
one gated full-attention layer, dense MLPs) is trained briefly on tiny's seeded synthetic text, and a Domino drafter
(which also serves the DFlash methods) is distilled on the target's own greedy continuations, so drafts really get
accepted. Written once in the Hugging Face layouts, to a temp dir and then renamed."""

from pathlib import Path

import torch

from dtrt import __version__
from dtrt.models.checkpoint import drafter_state, save_checkpoint, target_state
from dtrt.models.config import DrafterConfig, TargetConfig
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.hybrid import HybridCache, HybridTarget
from dtrt.train.distill import DistillConfig, distill
from dtrt.zoo import tiny

TINY_HYBRID_VERSION = 1

TARGET_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": tiny.VOCAB,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 0,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "eos_token_id": tiny.EOS,
    "bos_token_id": tiny.EOS,
    "torch_dtype": "float32",
}


def build(path: Path, log=None, seed: int = 0, target_steps: int = 200, distill_steps: int = 300):
    """Create the tiny hybrid pair under `path` (target/, domino/); the registry stages the directory."""
    torch.manual_seed(seed)
    tmp = Path(path)
    tmp.mkdir(parents=True, exist_ok=True)
    data = torch.tensor(tiny.encode(tiny.corpus(300_000, seed)))
    cfg = TargetConfig.from_json(tiny._write_json(tmp / "target.json", TARGET_CONFIG))
    target = tiny.init_weights(HybridTarget(cfg))
    tiny.train_target(target, data, steps=target_steps, seed=seed, log=log)
    target.requires_grad_(False).eval()

    prompts = tiny._batches(data, 31, 256, torch.Generator().manual_seed(seed + 1))[:, :32]
    seqs = greedy_continuations(target, prompts, 64)
    cfg_json = tiny.drafter_config(domino=True)
    dcfg = DrafterConfig.from_dict(cfg_json)
    drafter = tiny.init_weights(Drafter(dcfg, DominoHead(dcfg.hidden_size, 32, 32, tiny.VOCAB)))
    with torch.no_grad():  # the drafter's final norm starts as the target's (stored as an offset from one)
        drafter.norm.weight.copy_(1 + target.model.norm.weight)
    if log:
        log("distilling the domino drafter")
    distill(
        target,
        drafter,
        seqs,
        tiny.features(target, seqs, dcfg.target_layer_ids),
        DistillConfig(steps=distill_steps, seed=seed),
        log=log,
    )
    save_checkpoint(tmp / "domino", cfg_json, drafter_state(drafter))
    save_checkpoint(tmp / "target", TARGET_CONFIG, target_state(target))
    tiny.write_tokenizer(tmp / "target")
    (tmp / "target.json").unlink()
    (tmp / "README.md").write_text(f"tiny-hybrid pair v{TINY_HYBRID_VERSION}, dtrt {__version__}, seed {seed}\n")
    return path


@torch.no_grad()
def greedy_continuations(target: HybridTarget, prompts, new_tokens: int):
    """Batched greedy continuation through a cache (the recurrent layers make recomputing the prefix slow):
    [S, P + new_tokens]."""
    b, n = prompts.shape
    cache = HybridCache(target.cfg, n + new_tokens, target.dtype, batch=(b,))
    seqs, ids = prompts, prompts
    for _ in range(new_tokens):
        m = ids.shape[1]
        logits, _ = target(
            ids, torch.arange(cache.past, cache.past + m), torch.ones(m, m, dtype=torch.bool).tril(), cache
        )
        cache.commit(torch.arange(m))
        ids = logits[:, -1:].argmax(-1)
        seqs = torch.cat((seqs, ids), dim=1)
    return seqs

"""`tiny`: a small seeded target + DFlash drafter + Domino drafter, written to disk in the released layouts.

The target is a character-level Qwen3 trained for a few seconds on seeded synthetic English, so its greedy text
is word-like; both drafters are then distilled on the target's own greedy continuations, so drafts really get
accepted. Everything is created once and cached on disk (write to a temp dir, then rename)."""

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from dtrt import __version__
from dtrt.models.checkpoint import drafter_state, save_checkpoint, target_state
from dtrt.models.config import DrafterConfig, TargetConfig
from dtrt.models.domino import DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.target import Target
from dtrt.train.distill import DistillConfig, distill

TINY_VERSION = 1
VOCAB = 128
EOS, UNK, NEWLINE = 0, 1, 2
MASK = VOCAB - 1  # an unused embedding row, as in Qwen3

WORDS = (
    "the a one every some small big old new red green blue quick lazy happy sad cat dog bird fish fox cow "
    "horse mouse tree house river road hill garden city sun moon star rain wind day night time way man woman "
    "child king queen friend runs sees likes takes makes finds gives wants needs jumps sleeps sings walks "
    "reads writes and but then so because while near over under with into from on in at to of is was "
    "very still always never often again home far away here there today"
).split()

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "eos_token_id": EOS,
    "bos_token_id": EOS,
    "torch_dtype": "float32",
}


def drafter_config(domino: bool) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "block_size": 8,
        "num_target_layers": 4,
        "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3]},
    }
    if domino:
        cfg["dflash_config"].update(
            projector_type="domino", gru_hidden_dim=32, emb_dim=32, pure_draft_prefix_len=1, shift_label=True
        )
    return cfg


def corpus(n_chars: int, seed: int) -> str:
    """Sentences from a sparse random word-bigram model: each word has four successors, one dominant."""
    rng = random.Random(seed)
    succ = {w: rng.sample(WORDS, 4) for w in WORDS}
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS[:16])
        sent = [w]
        for _ in range(rng.randint(4, 12)):
            w = rng.choices(succ[w], weights=(0.6, 0.25, 0.1, 0.05))[0]
            sent.append(w)
        s = " ".join(sent).capitalize() + ("." if rng.random() < 0.8 else "!") + ("\n" if rng.random() < 0.2 else " ")
        out.append(s)
        size += len(s)
    return "".join(out)


def encode(text: str) -> list[int]:
    return [NEWLINE if c == "\n" else c and (ord(c) - 29 if 32 <= ord(c) < 127 else UNK) for c in text]


def write_tokenizer(path: Path):
    """A character-level tokenizer in the Hugging Face `tokenizer.json` format: id = ord(c) - 29."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<|endoftext|>": EOS, "<unk>": UNK, "\n": NEWLINE}
    vocab.update({chr(c): c - 29 for c in range(32, 127)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
            },
            indent=2,
        )
        + "\n"
    )


def _batches(data, T, batch, gen):
    starts = torch.randint(0, len(data) - T - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + T + 1] for s in starts.tolist()])


def train_target(target: Target, data, steps=400, T=64, batch=16, lr=3e-3, seed=0, log=None):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(target.parameters(), lr=lr, weight_decay=0.01)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        xy = _batches(data, T, batch, gen)
        logits, _ = target(xy[:, :-1], torch.arange(T).expand(batch, T), mask)
        loss = F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"target step {step:4d}  loss {loss.item():.3f}")


@torch.no_grad()
def greedy_continuations(target: Target, prompts, new_tokens: int):
    """Batched greedy continuation without a cache (the model is tiny): [S, P + new_tokens]."""
    seqs = prompts
    for _ in range(new_tokens):
        T = seqs.shape[1]
        logits, _ = target(seqs, torch.arange(T).expand_as(seqs), torch.ones(T, T, dtype=torch.bool).tril())
        seqs = torch.cat((seqs, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return seqs


@torch.no_grad()
def features(target: Target, seqs, taps):
    T = seqs.shape[1]
    _, feats = target(seqs, torch.arange(T).expand_as(seqs), torch.ones(T, T, dtype=torch.bool).tril(), taps=taps)
    return feats


def init_drafter_from_target(drafter: Drafter, target: Target):
    """Start the draft layers from the target's last layers and the final norm from the target's."""
    n = len(drafter.layers)
    for d_layer, t_layer in zip(drafter.layers, target.model.layers[-n:]):
        d_layer.load_state_dict(t_layer.state_dict())
    drafter.norm.load_state_dict(target.model.norm.state_dict())


def init_weights(module: torch.nn.Module, std: float = 0.02):
    """The transformers initialisation: N(0, std) for linear and embedding weights, norms at one."""
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=std)
        elif isinstance(m, torch.nn.GRU):
            for w in m.parameters():
                torch.nn.init.normal_(w, std=std)
    return module


def build(path: Path, log=None, seed: int = 0):
    """Create the tiny pair under `path` (target/, dflash/, domino/); the registry stages the directory."""
    torch.manual_seed(seed)
    tmp = Path(path)
    tmp.mkdir(parents=True, exist_ok=True)
    text = corpus(300_000, seed)
    data = torch.tensor(encode(text))
    target = init_weights(Target(TargetConfig.from_json(_write_json(tmp / "target.json", TARGET_CONFIG))))
    train_target(target, data, seed=seed, log=log)
    target.requires_grad_(False).eval()

    gen = torch.Generator().manual_seed(seed + 1)
    prompts = _batches(data, 31, 256, gen)[:, :32]
    seqs = greedy_continuations(target, prompts, 64)
    for kind in ("dflash", "domino"):
        cfg_json = drafter_config(kind == "domino")
        cfg = DrafterConfig.from_json(_write_json(tmp / f"{kind}.json", cfg_json))
        feats = features(target, seqs, cfg.target_layer_ids)
        head = DominoHead(cfg.hidden_size, 32, 32, VOCAB) if kind == "domino" else None
        drafter = init_weights(Drafter(cfg, head))
        init_drafter_from_target(drafter, target)
        if log:
            log(f"distilling the {kind} drafter")
        distill(target, drafter, seqs, feats, DistillConfig(steps=300, seed=seed), log=log)
        save_checkpoint(tmp / kind, cfg_json, drafter_state(drafter))
    save_checkpoint(tmp / "target", TARGET_CONFIG, target_state(target))
    write_tokenizer(tmp / "target")
    for f in ("target.json", "dflash.json", "domino.json"):
        (tmp / f).unlink()
    (tmp / "README.md").write_text(f"tiny pair v{TINY_VERSION}, dtrt {__version__}, seed {seed}\n")
    return path


def _write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path

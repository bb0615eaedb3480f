"""Convert a llama-, qwen2- or qwen3-architecture GGUF file into a Hugging Face checkpoint directory: fp32 weights in
model.safetensors, config.json, generation_config.json and the tokenizer with its chat template, and beside them
the file's quantized tensors as it holds them (gguf_blocks.safetensors, dtrt.models.gguf_blocks: what a `--quant
gguf` export computes from). Offline; the `gguf` package reads and dequantizes the file."""

import json
from pathlib import Path

import numpy as np
import torch

from dtrt.artifacts.files import require_space, staging
from dtrt.errors import DtrtError
from dtrt.models.gguf_blocks import unkept, write_blocks

LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# architecture -> (transformers class, default RoPE base); qwen2's q/k/v biases are the target's attention_bias
ARCHS = {
    "llama": ("LlamaForCausalLM", 10000.0),
    "qwen2": ("Qwen2ForCausalLM", 1000000.0),
    "qwen3": ("Qwen3ForCausalLM", 1000000.0),
}
# the pre-tokenizer split of Qwen2/Qwen3's tokenizer.json (llama.cpp's pre-tokenizer name: qwen2)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
# llama.cpp's pre-tokenizer names whose regex splits every digit off first (llama-vocab.cpp)
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


def read_fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    return f"{TOP_TENSORS[base]}.{suffix}" if base in TOP_TENSORS else None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from rotate-half pairs (i, i + d/2) to
    interleaved pairs (2i, 2i + 1) for its RoPE kernel; our RoPE, like transformers', rotates halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def target_config(f: dict, has_output: bool, where: str = "GGUF file") -> dict:
    a = f["general.architecture"]
    if a not in ARCHS:
        raise DtrtError(f"{where}: architecture {a!r} is not supported (dtrt reads {', '.join(ARCHS)} GGUF files)")
    if f.get(f"{a}.rope.scaling.type", "none") != "none":
        raise DtrtError(f"{where}: uses RoPE scaling; only plain RoPE is supported")
    heads, hidden = f[f"{a}.attention.head_count"], f[f"{a}.embedding_length"]
    theta = float(f.get(f"{a}.rope.freq_base", ARCHS[a][1]))
    # GGUF stores eps as float32; its shortest float32 repr is the value the model was configured with
    eps = float(str(np.float32(f[f"{a}.attention.layer_norm_rms_epsilon"])))
    cfg = {
        "architectures": [ARCHS[a][0]],
        "model_type": a,
        "vocab_size": int(f.get(f"{a}.vocab_size") or len(f["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": f[f"{a}.feed_forward_length"],
        "num_hidden_layers": f[f"{a}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": f.get(f"{a}.attention.head_count_kv", heads),
        "head_dim": f.get(f"{a}.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": f[f"{a}.context_length"],
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": not has_output,
        "attention_bias": a == "qwen2",
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, gkey in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{gkey}_token_id" in f:
            cfg[f"{key}_token_id"] = int(f[f"tokenizer.ggml.{gkey}_token_id"])
    return cfg


def _rows(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """A tensor's rows (output features) in the checkpoint's order: a llama file's Q and K unpermuted."""
    if cfg["model_type"] != "llama":
        return w
    if name.endswith("q_proj.weight"):
        return unpermute_rows(w, cfg["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return unpermute_rows(w, cfg["num_key_value_heads"])
    return w


def read_blocks(reader, cfg: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's quantized tensors as raw block rows (uint8 [rows, bytes a row], rows in the checkpoint's order)
    by checkpoint name, and their GGUF types; float tensors are the checkpoint's own. A type dtrt cannot keep as
    blocks is recorded with no rows: the fp32 checkpoint holds it, and `--quant gguf` refuses it by name."""
    from dtrt.models.gguf_blocks import FLOATS, LAYOUT

    rows, kinds = {}, {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in FLOATS or (name := hf_name(t.name)) is None:
            continue
        kinds[name] = kind
        if kind not in LAYOUT:
            continue
        raw = np.asarray(t.data).view(np.uint8)
        rows[name] = torch.from_numpy(np.array(_rows(name, raw, cfg), order="C"))
    return rows, kinds


def read_weights(reader, cfg: dict, log=None) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    state = {}
    for i, t in enumerate(reader.tensors):
        name = hf_name(t.name)
        if name is None:
            raise DtrtError(f"GGUF tensor {t.name!r} has no Hugging Face Llama counterpart; unsupported model")
        w = _rows(name, np.array(dequantize(t.data, t.tensor_type), dtype=np.float32), cfg)  # HF [out, in]
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
        if log and (i + 1) % 50 == 0:
            log(f"  dequantized {i + 1}/{len(reader.tensors)} tensors")
    return state


def write_tokenizer(f: dict, path: Path):
    """tokenizer.json rebuilt from the GGUF vocabulary and merges, tokenizer_config.json with the chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if f.get("tokenizer.ggml.model") != "gpt2":
        raise DtrtError(f"GGUF tokenizer {f.get('tokenizer.ggml.model')!r} is not supported (only byte-level BPE)")
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if f.get("tokenizer.ggml.pre") == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif f.get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    bos = f.get("tokenizer.ggml.bos_token_id")
    if f.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    tok.save(str(path / "tokenizer.json"))

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(f[f"{f['general.architecture']}.context_length"]),
    }
    for key, gkey in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        if f"tokenizer.ggml.{gkey}_token_id" in f:
            tcfg[key] = tokens[f[f"tokenizer.ggml.{gkey}_token_id"]]
    if "tokenizer.chat_template" in f:
        tcfg["chat_template"] = f["tokenizer.chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")


def convert(gguf_path: Path, out: Path, log=None) -> Path:
    """Write the HF checkpoint directory `out` from `gguf_path`, staged (a temporary sibling, then a rename)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    f = read_fields(reader)
    cfg = target_config(f, any(t.name == "output.weight" for t in reader.tensors), str(gguf_path))
    # every tensor dequantized to fp32, and the quantized ones again as blocks (at most the file's size)
    need = sum(int(t.n_elements) * 4 for t in reader.tensors) + gguf_path.stat().st_size
    require_space(out, need, f"converting {gguf_path.name}")
    with staging(out) as tmp:
        tmp.chmod(0o755)
        state = read_weights(reader, cfg, log)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        blocks, kinds = read_blocks(reader, cfg)
        write_blocks(tmp, blocks, kinds, gguf_path.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        write_tokenizer(f, tmp)
    return out


def converted(gguf_path: Path, log=None) -> Path:
    """The checkpoint of a user's GGUF file (`dtrt export --gguf`), converted once into the cache, keyed by the
    file's sha256; one line for a missing or unreadable file."""
    from dtrt.artifacts.files import cache_dir, sha256

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise DtrtError(f"--gguf {gguf_path}: no such file")
    with open(gguf_path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise DtrtError(f"--gguf {gguf_path}: not a GGUF file (it does not start with GGUF's magic)")
    out = cache_dir() / "gguf" / f"{gguf_path.stem}-{sha256(gguf_path)[:16]}"
    if (out / "config.json").is_file():
        if not (stale := unkept(out)):
            return out
        if log:  # converted by a dtrt that kept fewer types as blocks: made again, in place
            log(f"converting {gguf_path.name} again into {out}: an older dtrt kept {len(stale)} of its tensors as fp32")
    elif log:
        log(f"converting {gguf_path.name} into {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert(gguf_path, out, log)

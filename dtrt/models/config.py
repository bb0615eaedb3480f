"""Model configs read from Hugging Face `config.json` files (target) and z-lab / Domino drafters."""

import json
from dataclasses import dataclass
from pathlib import Path

from dtrt.errors import DtrtError

TARGET_ARCHS = {"qwen3": True, "llama": False, "qwen2": False}  # model_type -> has per-head q_norm/k_norm


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DtrtError(f"{path}: not found; pass a checkpoint directory holding config.json and *.safetensors")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DtrtError(
            f"{path}: not valid JSON ({e.__class__.__name__}: {e}); restore the file from the checkpoint"
        ) from None


def generation_eos(folder: Path) -> tuple[int, ...]:
    """The EOS ids of `folder`/generation_config.json (`eos_token_id`: an id or a list of ids; Qwen3 lists
    <|im_end|> and <|endoftext|> there while its config.json names only the first); () without the file or key."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise DtrtError(f"{path}: not a JSON object; restore the file from the checkpoint")
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DtrtError(
            f"{path}: eos_token_id {eos!r} must be a token id or a list of token ids; restore the file from the "
            "checkpoint"
        )
    return tuple(ids)


def _rope_theta(cfg: dict, default: float) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise DtrtError(f"config.json: rope type {kind!r} is not supported (only plain RoPE)")
    return float(cfg.get("rope_theta", params.get("rope_theta", default)))


def _require(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise DtrtError(f"{path}: missing config key {key!r}")
    return cfg[key]


@dataclass
class TargetConfig:
    arch: str  # "qwen3" | "llama" | "qwen2" | "qwen3_next" (HybridConfig)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return TARGET_ARCHS[self.arch]

    @classmethod
    def from_json(cls, path: Path) -> "TargetConfig":
        cfg = read_json(path)
        arch = cfg.get("model_type")
        if arch in HYBRID_ARCHS:
            return HybridConfig.from_dict(cfg, path)
        if arch not in TARGET_ARCHS:
            raise DtrtError(
                f"{path}: model_type {arch!r} is not a supported target "
                f"(supported: {', '.join((*TARGET_ARCHS, *HYBRID_ARCHS))})"
            )
        return cls(**_target_fields(cfg, path))


def _target_fields(cfg: dict, path: Path, head_dim: int | None = None) -> dict:
    """The TargetConfig fields of a config.json (head_dim: the architecture's default when the key is absent)."""
    heads = _require(cfg, "num_attention_heads", path)
    hidden = _require(cfg, "hidden_size", path)
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return dict(
        arch=cfg.get("model_type"),
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size", path),
        num_layers=_require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or head_dim or hidden // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, 10000.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),  # Qwen2: q/k/v biases
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_id=eos,
    )


HYBRID_ARCHS = ("qwen3_next",)
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class HybridConfig(TargetConfig):
    """A Qwen3-Next hybrid target: Gated-DeltaNet ("linear_attention") layers interleaved with gated
    full-attention layers by `layer_types`; dense MLPs only (num_experts 0 or every layer in mlp_only_layers)."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every head."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def recurrent_dims(self) -> dict:
        """What a runtime needs to hold the recurrent caches (also recorded in an export's manifest)."""
        return {
            "kv_layers": len(self.attention_layers),
            "recurrent_layers": len(self.recurrent_layers),
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "conv_dim": self.conv_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
        }

    @classmethod
    def from_dict(cls, cfg: dict, path: Path) -> "HybridConfig":
        layers = _require(cfg, "num_hidden_layers", path)
        types = cfg.get("layer_types")
        if types is None:  # transformers' default pattern: every `full_attention_interval`-th layer attends
            interval = int(cfg.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise DtrtError(f"{path}: layer_types must list {layers} entries of {' / '.join(LAYER_TYPES)}")
        experts, step = int(cfg.get("num_experts", 512)), int(cfg.get("decoder_sparse_step", 1)) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0]
        if sparse:
            raise DtrtError(
                f"{path}: layer {sparse[0]} is a sparse MoE layer (num_experts {experts}); only dense "
                "Qwen3-Next targets are supported (num_experts 0 or every layer in mlp_only_layers)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise DtrtError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
        linear = {
            k: int(cfg.get(k, cls.__dataclass_fields__[k].default))
            for k in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            )
        }
        if linear["linear_num_value_heads"] % linear["linear_num_key_heads"] or linear["linear_conv_kernel_dim"] < 2:
            raise DtrtError(
                f"{path}: linear_num_value_heads must be a multiple of linear_num_key_heads and "
                "linear_conv_kernel_dim at least 2"
            )
        rotary = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
        return cls(
            **_target_fields(cfg, path, head_dim=256),
            layer_types=tuple(types),
            **linear,
            partial_rotary_factor=float(rotary),
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's build_target_layer_ids: evenly spread taps, 0-based decoder layer outputs."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    """A DFlash drafter (z-lab layout), optionally with the Domino head (G, E come from tensor shapes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    projector_type: str | None = None  # "domino" / "causal_v5" when the checkpoint carries a head
    shift_label: bool = False
    pure_draft_prefix_len: int = 1

    @property
    def k_draft(self) -> int:
        """Draft depths per block: shift_label uses all B rows (row i predicts slot i+1), DFlash rows 1..B-1."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def first_row(self) -> int:
        return 0 if self.shift_label else 1

    @classmethod
    def from_json(cls, path: Path, head: bool = False) -> "DrafterConfig":
        return cls.from_dict(read_json(path), path, head)

    @classmethod
    def from_dict(cls, cfg: dict, path: Path = Path("config.json"), head: bool = False) -> "DrafterConfig":
        """The config of a drafter; `head`: whether its checkpoint holds Domino head tensors (a Domino drafter must
        say shift_label, see _shift_label)."""
        dcfg = cfg.get("dflash_config") or {}
        heads = _require(cfg, "num_attention_heads", path)
        hidden = _require(cfg, "hidden_size", path)
        layers = _require(cfg, "num_hidden_layers", path)
        block = cfg.get("block_size", dcfg.get("block_size"))
        if block is None:
            raise DtrtError(f"{path}: missing 'block_size' (top level or dflash_config); is this a DFlash drafter?")
        mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise DtrtError(f"{path}: missing 'dflash_config.mask_token_id'; is this a DFlash drafter?")
        taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
        if taps is None:
            taps = default_target_layer_ids(_require(cfg, "num_target_layers", path), layers)
        proj = dcfg.get("projector_type", cfg.get("projector_type"))
        if proj is not None and proj not in ("domino", "causal_v5"):
            raise DtrtError(f"{path}: projector_type {proj!r} is not supported (domino, causal_v5)")
        return cls(
            vocab_size=_require(cfg, "vocab_size", path),
            hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size", path),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg, 1e6),
            block_size=int(block),
            mask_token_id=int(mask),
            target_layer_ids=[int(t) for t in taps],
            projector_type=proj,
            shift_label=_shift_label(dcfg.get("shift_label", cfg.get("shift_label")), proj, head, int(block), path),
            pure_draft_prefix_len=_prefix_len(
                dcfg.get("pure_draft_prefix_len", cfg.get("pure_draft_prefix_len", 1)), path
            ),
        )


def _shift_label(value, projector: str | None, head: bool, block: int, path: Path) -> bool:
    """shift_label as the config says it (`dflash_config`, or the top level). A DFlash drafter (no projector_type,
    no head tensors) that leaves it out uses DFlash's rows 1..B-1 by definition; a Domino drafter that leaves it out
    is refused, since it decides how many tokens a block drafts and no tensor tells."""
    if value is None:
        if projector is None and not head:
            return False
        raise DtrtError(
            f"{path}: a Domino drafter's config needs 'dflash_config.shift_label', which decides the tokens "
            f"drafted per block (true: {block}, row 0 drafts, as the released Domino-b16 configs say; false: "
            f"DFlash's {block - 1}); add the value its training used"
        )
    if not isinstance(value, bool):
        raise DtrtError(f"{path}: shift_label {value!r} must be true or false")
    return value


def _prefix_len(value, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DtrtError(f"{path}: pure_draft_prefix_len {value!r} must be an integer >= 0")
    return value

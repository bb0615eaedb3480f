"""Loaders for Hugging Face checkpoint directories: config.json + model.safetensors (or shards listed in
model.safetensors.index.json). Tensor names and shapes are checked against the config before anything is
built, and every problem is a one-line DtrtError naming the file."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dtrt.errors import DtrtError
from dtrt.models.config import DrafterConfig, HybridConfig, TargetConfig, read_json
from dtrt.models.domino import HEAD_MODULES, HEAD_PREFIXES, HEAD_TENSORS, DominoHead
from dtrt.models.drafter import Drafter
from dtrt.models.hybrid import HybridTarget
from dtrt.models.target import Target

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DtrtError(f"--dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Checkpoint:
    """The tensors of one checkpoint directory, read lazily: name -> file, shape."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise DtrtError(f"{self.path}: checkpoint directory not found")
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
                raise DtrtError(
                    f"{index}: not a valid safetensors index ({e.__class__.__name__}); restore the file"
                ) from None
            files = [self.path / f for f in sorted(set(weight_map.values()))]
        else:
            raise DtrtError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json; "
                "pass a Hugging Face checkpoint directory"
            )
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            if not f.is_file():
                raise DtrtError(f"{f}: not found (listed in model.safetensors.index.json); download the missing shard")
            try:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        self.file_of[name] = f
                        self.shapes[name] = tuple(st.get_slice(name).get_shape())
            except Exception as e:  # safetensors raises several types for truncated or corrupt headers
                raise DtrtError(f"{f}: not a readable safetensors file ({e}); re-download it") from None
        self.files = files

    def __contains__(self, name):
        return name in self.shapes

    def check(self, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()):
        """Every expected tensor is present with its shape; nothing unknown is left over."""
        for name, shape in expected.items():
            if name not in self.shapes:
                if name in optional:
                    continue
                raise DtrtError(
                    f"{self.path}: tensor {name!r} is missing (config.json expects it); "
                    "is this the right kind of checkpoint?"
                )
            if self.shapes[name] != tuple(shape):
                raise DtrtError(
                    f"{self.file_of[name]}: tensor {name!r} has shape {list(self.shapes[name])}, "
                    f"config.json implies {list(shape)}"
                )
        extra = [n for n in self.shapes if n not in expected and not n.endswith(IGNORED_SUFFIXES)]
        if extra:
            raise DtrtError(
                f"{self.path}: unexpected tensor {extra[0]!r} ({len(extra)} in all); "
                "is this the right kind of checkpoint?"
            )

    def load(self, names, dtype) -> dict[str, torch.Tensor]:
        out = {}
        for f in self.files:
            wanted = [n for n in names if self.file_of.get(n) == f]
            if not wanted:
                continue
            with safe_open(str(f), framework="pt") as st:
                for n in wanted:
                    out[n] = st.get_tensor(n).to(dtype)
        return out


def load_target(path, dtype=torch.float32) -> Target:
    path = Path(path)
    cfg = TargetConfig.from_json(path / "config.json")
    ckpt = Checkpoint(path)
    with torch.device("meta"):
        model = HybridTarget(cfg) if isinstance(cfg, HybridConfig) else Target(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    ckpt.check(expected, optional)
    state = ckpt.load([k for k in expected if k in ckpt], dtype)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def head_prefix(ckpt: Checkpoint) -> str | None:
    """Where the checkpoint keeps the Domino head's tensors (one of HEAD_PREFIXES; None: it has no head). Tensors that
    look like a head's but are not the released head's (a partial head, a head under two prefixes, extra head
    modules) are a one-line error."""
    path = ckpt.path
    found = [p for p in HEAD_PREFIXES if any(p + n in ckpt for n in HEAD_TENSORS)]
    if len(found) > 1:
        a, b = (next(p + n for n in HEAD_TENSORS if p + n in ckpt) for p in found[:2])
        raise DtrtError(f"{path}: Domino head tensors under two names ({a!r} and {b!r}); a checkpoint holds one head")
    prefix = found[0] if found else None
    head = [prefix + n for n in HEAD_TENSORS] if prefix is not None else []
    if missing := next((n for n in head if n not in ckpt), None):
        raise DtrtError(f"{path}: Domino head tensor {missing!r} is missing; the checkpoint is incomplete")
    modules = tuple(p + m for p in HEAD_PREFIXES for m in HEAD_MODULES) + tuple(p for p in HEAD_PREFIXES if p)
    if stray := next((n for n in ckpt.shapes if n.startswith(modules) and n not in head), None):
        raise DtrtError(
            f"{path}: tensor {stray!r} is not part of the released Domino head (prefix_gru.weight_{{ih,hh}}_l0 and "
            "embed_proj.{0,2}.weight, flat or under logit_head. or logits_correction.); is this the right kind of "
            "checkpoint?"
        )
    return prefix


def load_drafter(path, dtype=torch.float32) -> Drafter:
    """A DFlash or Domino drafter; the Domino head may be stored flat or under a HEAD_PREFIXES prefix."""
    path = Path(path)
    raw = read_json(path / "config.json")
    ckpt = Checkpoint(path)
    prefix = head_prefix(ckpt)
    cfg = DrafterConfig.from_dict(raw, path / "config.json", head=prefix is not None)
    head = None
    if prefix is not None:
        gru_dim, emb_dim = DominoHead.dims_from_shapes({n: ckpt.shapes[prefix + n] for n in HEAD_TENSORS})
        with torch.device("meta"):
            head = DominoHead(cfg.hidden_size, gru_dim, emb_dim, cfg.vocab_size)
    elif cfg.projector_type is not None:
        raise DtrtError(
            f"{path}: config.json says projector_type {cfg.projector_type!r} but the checkpoint has no "
            "Domino head tensors (prefix_gru.*, embed_proj.*, flat or under logit_head. or logits_correction.)"
        )
    with torch.device("meta"):
        model = Drafter(cfg)
    model.head = head
    # the checkpoint's name of each parameter: the body's as is, the head's under its prefix
    shapes = model.state_dict()
    names = {(prefix + k.removeprefix("head.") if k.startswith("head.") else k): k for k in shapes}
    ckpt.check({n: tuple(shapes[k].shape) for n, k in names.items()})
    state = ckpt.load(list(names), dtype)
    model.load_state_dict({names[n]: v for n, v in state.items()}, strict=True, assign=True)
    return model.eval()


def check_pair(target: Target, drafter: Drafter, drafter_path="drafter"):
    """A drafter reads the target's features and uses its embedding and lm_head: the dims must agree."""
    t, d = target.cfg, drafter.cfg
    if d.hidden_size != t.hidden_size:
        raise DtrtError(
            f"{drafter_path}: drafter hidden_size {d.hidden_size} does not match the target's "
            f"{t.hidden_size}; use the drafter trained for this target"
        )
    if d.vocab_size != t.vocab_size:
        raise DtrtError(
            f"{drafter_path}: drafter vocab_size {d.vocab_size} does not match the target's "
            f"{t.vocab_size}; use the drafter trained for this target"
        )
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise DtrtError(
            f"{drafter_path}: target_layer_ids {d.target_layer_ids} name layer {bad[0]}, but the target "
            f"has {t.num_layers} layers"
        )
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise DtrtError(f"{drafter_path}: mask_token_id {d.mask_token_id} is outside the target vocabulary")


def save_checkpoint(path, config: dict, state: dict[str, torch.Tensor], shards: int = 1):
    """Write config.json and the tensors in the Hugging Face layout (one file, or `shards` files plus
    model.safetensors.index.json). Used to create test and example checkpoints."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[s::shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def target_state(model: Target) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def drafter_state(model: Drafter) -> dict[str, torch.Tensor]:
    return {k.removeprefix("head."): v for k, v in model.state_dict().items()}

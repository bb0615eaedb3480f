"""A reduced draft vocabulary: the drafter's base logits over a subset of the target's vocabulary (FR-Spec,
EAGLE-3's `draft_vocab_size`).

The subset lives beside the drafter checkpoint as `d2t.safetensors` in EAGLE-3's convention: `d2t` Long[V'] holds
offsets (target id = i + d2t[i], the draft ids in ascending target order) and `t2d` Bool[V] marks the target ids
the subset holds. The drafter's head multiplies its rows by the lm_head's rows of the subset only: base logits over
V' columns, which a round carries with the ids (dtrt.tree.scorer.Round). The marginal builders take their top-k over
the columns and map them back; a consumer that indexes the whole vocabulary (Domino's scorer and the exported
scorer stages) reads the full row, -inf outside the subset (vLLM's layout), made on demand. No builder ever picks a
token outside the subset, and at T>0 none has draft probability, so the target's own sample carries it and the
output stays the target's own.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dtrt.errors import DtrtError

FILE = "d2t.safetensors"
FORMAT = "dtrt-draft-vocab/1"


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor
    """Long[V']: the target ids of the subset, ascending (the draft ids are their positions)."""
    vocab_size: int
    """V: the target's vocabulary."""
    sha256: str
    """Of the ids, as the export manifest and the cache key record it."""
    source: str = ""
    """The file it came from (messages)."""

    @classmethod
    def from_ids(cls, ids, vocab_size: int, source: str = "") -> "DraftVocab":
        ids = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
            raise DtrtError(f"{source or 'draft vocabulary'}: ids must lie in 0..{vocab_size - 1}")
        return cls(ids, vocab_size, ids_sha256(ids), source)

    @property
    def size(self) -> int:
        return self.ids.numel()

    def d2t(self) -> torch.Tensor:
        """EAGLE-3's offsets: target id = draft id + d2t[draft id]."""
        return self.ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def record(self) -> dict:
        """What an export's manifest keeps of it."""
        return {"size": self.size, "vocab_size": self.vocab_size, "sha256": self.sha256}

    def save(self, path: Path, meta: dict | None = None):
        """Write `path` (d2t + t2d, with `meta` as JSON metadata) under a temporary name, then rename it."""
        from safetensors.torch import save

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        metadata = {"format": FORMAT, "meta": json.dumps({"vocab_size": self.vocab_size, **(meta or {})})}
        tmp.write_bytes(sorted_header(save({"d2t": self.d2t(), "t2d": self.t2d()}, metadata=metadata)))
        tmp.replace(path)


def sorted_header(data: bytes) -> bytes:
    """A safetensors file's bytes with its JSON header's keys in sorted order: safetensors writes its metadata in a
    hash map's order, which changes from process to process, and an export's files should be the same bytes each
    time it is made. The header keeps its length (the same keys and values), so no offset moves."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    if len(header) > n:  # another escaping than safetensors' own: leave the file as written
        return data
    return data[:8] + header.ljust(n) + data[8 + n :]


def ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


def read_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}"))


def load_draft_vocab(path, vocab_size: int, must_hold=(), tokenizer_sha256: str | None = None) -> DraftVocab:
    """The subset in `path` (a d2t.safetensors file) for a target of `vocab_size` tokens, checked in one line each:
    its t2d covers exactly this vocabulary, d2t and t2d agree, it holds every id of `must_hold` (the EOS ids), and,
    where the file records the tokenizer it was counted with, that tokenizer is `tokenizer_sha256`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise DtrtError(f"--draft-vocab {path}: no such file; write one with `dtrt draft-vocab`, or use full")
    try:
        t = load_file(str(path))
        meta = read_meta(path)
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise DtrtError(f"{path}: not a readable draft vocabulary ({e}); write it with `dtrt draft-vocab`") from None
    if "d2t" not in t:
        raise DtrtError(f"{path}: holds no d2t tensor; it is not a draft vocabulary (EAGLE-3's d2t/t2d layout)")
    d2t = t["d2t"].to(torch.long)
    ids = d2t + torch.arange(d2t.numel())
    fix = "write one for this target with `dtrt draft-vocab`, or use --draft-vocab full"
    if "t2d" in t and t["t2d"].numel() != vocab_size:
        raise DtrtError(
            f"{path}: made for a vocabulary of {t['t2d'].numel()} tokens, the target has {vocab_size}; {fix}"
        )
    if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or ids[0] < 0 or ids[-1] >= vocab_size:
        raise DtrtError(f"{path}: its d2t does not map to ascending ids of a {vocab_size}-token vocabulary; {fix}")
    if "t2d" in t and not torch.equal(t["t2d"].to(torch.bool).nonzero().flatten(), ids):
        raise DtrtError(f"{path}: its d2t and t2d name different tokens; {fix}")
    if tokenizer_sha256 and meta.get("tokenizer_sha256") not in (None, tokenizer_sha256):
        raise DtrtError(f"{path}: counted with another tokenizer than the target's tokenizer.json; {fix}")
    held = set(ids.tolist())
    if missing := [i for i in must_hold if i not in held]:
        raise DtrtError(f"{path}: lacks the EOS id(s) {missing}, so a draft could never end; {fix}")
    return DraftVocab(ids, vocab_size, ids_sha256(ids), str(path))


class DraftHead(nn.Module):
    """The target's lm_head as the drafter uses it: over the draft vocabulary only (None: the whole one), base
    logits float32[rows, V'], column i for target id `ids[i]` (dtrt.tree.scorer.Round keeps the two together)."""

    def __init__(self, lm_head: nn.Linear, vocab: DraftVocab | None = None):
        super().__init__()
        self.vocab_size = lm_head.weight.shape[0]
        if vocab is None:
            self.lm_head, self.ids = lm_head, None
            return
        if vocab.vocab_size != self.vocab_size:
            raise DtrtError(
                f"{vocab.source or 'draft vocabulary'}: made for {vocab.vocab_size} tokens, the lm_head has "
                f"{self.vocab_size}"
            )
        rows = lm_head.weight.detach()[vocab.ids.to(lm_head.weight.device)].clone()
        self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)
        self.register_buffer("ids", vocab.ids.to(rows.device), persistent=False)

    def columns(self) -> tuple[torch.Tensor | None, int | None]:
        """(ids, V) of a subset head, (None, None) of a whole-vocabulary one: Round's `ids` and `vocab_size`."""
        return (None, None) if self.ids is None else (self.ids, self.vocab_size)

    def forward(self, ph: torch.Tensor) -> torch.Tensor:
        return self.lm_head(ph.to(self.lm_head.weight.dtype)).float()


def resolve_draft_vocab(
    choice: str | Path | None, drafter_path, vocab_size: int, must_hold=(), tokenizer_sha256: str | None = None
) -> DraftVocab | None:
    """The subset `--draft-vocab` names: None or "auto", the drafter's own d2t.safetensors when it has one (else the
    whole vocabulary); "full", the whole vocabulary (None); a path, that file."""
    if choice == "full":
        return None
    if choice in (None, "auto"):
        path = Path(drafter_path) / FILE if drafter_path is not None else None
        if path is None or not path.is_file():
            return None
    else:
        path = Path(choice)
    return load_draft_vocab(path, vocab_size, must_hold, tokenizer_sha256)


def draft_vocab_file(kind: str) -> str:
    """Where an export keeps a drafter kind's subset."""
    return f"{kind}.{FILE}"


def check_vocab_size(vocab: DraftVocab | None, topm: int, node_topk: int):
    """The tree builders take the top `topm` base candidates of a depth and `node_topk` children of a node: a subset
    must hold at least that many tokens, or some would be -inf ties, drafted in no defined order."""
    if vocab is None:
        return
    need, flag = max((topm, "--topm"), (node_topk, "--node-topk"))
    if vocab.size < need:
        raise DtrtError(
            f"--draft-vocab {vocab.source or ''}: {vocab.size} tokens, fewer than {flag} {need}; lower {flag} or use "
            "a larger subset (dtrt draft-vocab --size)"
        )

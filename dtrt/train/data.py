"""Training data for a drafter, made by the target itself: fixed-length rows of tokens, the target's greedy
token for every position (labels), and the target's tapped features, all from batched forwards.

Two sources: text (corpus files, teacher-forced: labels are the target's greedy predictions given the real
prefix) and the target's own greedy continuations of prompts (labels are the tokens themselves)."""
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrt.errors import DtrtError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl")


@dataclass
class DrafterData:
    tokens: torch.Tensor   # Long [S, T]
    labels: torch.Tensor   # Long [S, T]: labels[:, t] is the target's greedy token at position t
    lengths: torch.Tensor  # Long [S]
    feats: torch.Tensor    # [S, T, taps*H], stored in fp16

    def __len__(self):
        return self.tokens.shape[0]

    def save(self, path: Path):
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: Path) -> "DrafterData":
        return cls(**torch.load(path))


def read_corpus(paths, max_chars: int) -> str:
    """Text of the given files or directories (recursively, text-like suffixes), up to max_chars."""
    out, size = [], 0
    for p in map(Path, paths):
        if not p.exists():
            raise DtrtError(f"--corpus {p}: not found")
        files = sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
        for f in files:
            text = f.read_text(errors="ignore")
            out.append(text[: max_chars - size])
            size += len(out[-1])
            if size >= max_chars:
                return "\n".join(out)
    return "\n".join(out)


def text_rows(tokenizer, text: str, T: int, max_rows: int) -> torch.Tensor:
    ids = []
    for i in range(0, len(text), 4096):  # pieces stay under the tokenizer's model_max_length
        ids += tokenizer.encode(text[i:i + 4096], add_special_tokens=False)
        if len(ids) >= T * max_rows:
            break
    n = min(len(ids) // T, max_rows)
    return torch.tensor(ids[: n * T], dtype=torch.long).reshape(n, T)


@torch.no_grad()
def greedy_labels_and_features(target, rows, batch: int, device, log=None):
    """One batched causal forward per chunk of rows: (labels, features fp16)."""
    S, T = rows.shape
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    labels = torch.empty_like(rows)
    feats = None
    for i in range(0, S, batch):
        x = rows[i:i + batch].to(device)
        logits, taps = target(x, torch.arange(T, device=device).expand_as(x), mask)
        labels[i:i + batch, 0] = rows[i:i + batch, 0]
        labels[i:i + batch, 1:] = logits[:, :-1].argmax(-1).cpu()
        if feats is None:
            feats = torch.empty(S, T, taps.shape[-1], dtype=torch.float16)
        feats[i:i + batch] = taps.to(torch.float16).cpu()
        if log:
            log(min(i + batch, S), S)
    return labels, feats


@torch.no_grad()
def continuations(pipeline, prompts: list[list[int]], new_tokens: int, T: int, log=None) -> torch.Tensor:
    """The target's own greedy continuation of each prompt, cut or padded (with the last token) to T."""
    from dtrt.runtime.sampling import SamplingConfig

    rows = []
    for i, ids in enumerate(prompts):
        out = pipeline.generate(ids[-(T // 2):], new_tokens, SamplingConfig()).tokens
        seq = (ids[-(T // 2):] + out)[:T]
        rows.append(seq + [seq[-1]] * (T - len(seq)))
        if log:
            log(i + 1, len(prompts))
    return torch.tensor(rows, dtype=torch.long)

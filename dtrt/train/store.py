"""A drafter's training data on disk (`<run>/.train/data/`): token rows and their valid lengths (`rows.pt`), and for
every position the target's greedy token (the label), its top-k ids and its tapped features, in memory-mapped .npy
files. The build fills them a chunk of rows at a time and records the finished count in `progress.json`, so an
interrupted build resumes where it stopped; training reads only the rows of each batch, so the data may be far
larger than memory (SmolLM2: 1.5 MB of features per 256-token row)."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dtrt.errors import DtrtError

TOPK = 8  # the target's top-k ids kept per position: the sampled loss always scores them


@dataclass
class DrafterData:
    tokens: torch.Tensor  # Long [S, T]
    lengths: torch.Tensor  # Long [S]: the valid prefix of each row
    labels: np.ndarray  # int32 [S, T]: labels[:, t] is the target's greedy token at position t
    topk: np.ndarray  # int32 [S, T, TOPK]: the target's top-k ids at position t (labels[:, t] among them)
    feats: np.ndarray  # fp16 [S, T, taps*H]

    def __len__(self):
        return self.tokens.shape[0]

    def rows(self, idx: torch.Tensor, device) -> dict:
        """The batch of rows `idx` (in that order) as tensors on `device`."""
        i = idx.numpy()
        return {
            "tokens": self.tokens[idx].to(device),
            "lengths": self.lengths[idx].to(device),
            "labels": torch.from_numpy(self.labels[i].astype(np.int64)).to(device),
            "topk": torch.from_numpy(self.topk[i].astype(np.int64)).to(device),
            "feats": torch.from_numpy(np.ascontiguousarray(self.feats[i])).to(device),
        }

    def split(self, n: int) -> "DrafterData":
        """The first len - n rows (views, nothing copied)."""
        k = len(self) - n
        return DrafterData(self.tokens[:k], self.lengths[:k], self.labels[:k], self.topk[:k], self.feats[:k])


def _arrays(path: Path, S: int, T: int, F: int, mode: str) -> dict:
    shapes = {"labels": ((S, T), np.int32), "topk": ((S, T, TOPK), np.int32), "feats": ((S, T, F), np.float16)}
    out = {}
    for name, (shape, dtype) in shapes.items():
        f = path / f"{name}.npy"
        if mode == "w+":
            out[name] = np.lib.format.open_memmap(f, mode="w+", dtype=dtype, shape=shape)
        else:
            out[name] = np.load(f, mmap_mode=mode)
            if out[name].shape != shape or out[name].dtype != dtype:
                raise DtrtError(f"{f}: holds {out[name].shape} {out[name].dtype}, not {shape} {dtype}; delete {path}")
    return out


def _progress(path: Path) -> dict:
    return json.loads((path / "progress.json").read_text())


def _write_progress(path: Path, progress: dict):
    tmp = path / "progress.json.tmp"
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, path / "progress.json")


def started(path: Path) -> bool:
    return (Path(path) / "progress.json").is_file()


def create(path: Path, tokens: torch.Tensor, lengths: torch.Tensor, feat_dim: int):
    """Lay out the store for these rows; `fill` computes what the target says of them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": tokens, "lengths": lengths}, path / "rows.pt")
    _arrays(path, *tokens.shape, feat_dim, "w+")
    _write_progress(path, {"rows": tokens.shape[0], "seq_len": tokens.shape[1], "feat_dim": feat_dim, "done": 0})


@torch.no_grad()
def fill(path: Path, target, taps, device, batch: int = 8, log=None) -> dict:
    """Run the target over the rows not done yet, one batched causal forward per chunk; returns the progress."""
    path = Path(path)
    progress = _progress(path)
    rows = torch.load(path / "rows.pt")["tokens"]
    S, T = rows.shape
    out = _arrays(path, S, T, progress["feat_dim"], "r+")
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    for i in range(progress["done"], S, batch):
        x = rows[i : i + batch].to(device)
        logits, hidden = target(x, torch.arange(T, device=device).expand_as(x), mask, taps=taps)
        top = logits.topk(TOPK, dim=-1).indices  # top-1 is the argmax
        out["labels"][i : i + batch, 0] = x[:, 0].cpu().numpy()
        out["labels"][i : i + batch, 1:] = top[:, :-1, 0].cpu().numpy()
        out["topk"][i : i + batch, 0] = x[:, :1].cpu().numpy()  # the first token has no prediction: itself only
        out["topk"][i : i + batch, 1:] = top[:, :-1].cpu().numpy()
        out["feats"][i : i + batch] = hidden.to(torch.float16).cpu().numpy()
        for a in out.values():
            a.flush()
        progress["done"] = min(i + batch, S)
        _write_progress(path, progress)
        if log:
            log(progress["done"], S)
    return progress


def load(path: Path) -> DrafterData:
    path = Path(path)
    progress = _progress(path)
    if progress["done"] < progress["rows"]:
        raise DtrtError(f"{path}: {progress['done']} of {progress['rows']} rows built; --resume finishes it")
    rows = torch.load(path / "rows.pt")
    arrays = _arrays(path, progress["rows"], progress["seq_len"], progress["feat_dim"], "r")
    return DrafterData(rows["tokens"], rows["lengths"], **arrays)

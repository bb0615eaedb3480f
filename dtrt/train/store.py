"""A drafter's training data on disk (`<run>/.train/data/`): token rows and their valid lengths (`rows.pt`), and for
every position the target's greedy token (the label), its top-k ids and its tapped features, in memory-mapped .npy
files. The build fills them a chunk of rows at a time and records the finished count in `progress.json`, so an
interrupted build resumes where it stopped; training reads only the rows of each batch, so the data may be far
larger than memory (SmolLM2: 1.5 MB of features per 256-token row). `in_memory` builds the same data straight
onto the training device instead (a GPU with room for it: nothing written, rebuilt on every run).

A store's `feats` is a memory-mapped array, or a tensor on the device for data built in memory."""

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
    feats: np.ndarray | torch.Tensor  # fp16 [S, T, taps*H]

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
            "feats": self.feats[idx.to(self.feats.device)].to(device)
            if isinstance(self.feats, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(self.feats[i])).to(device),
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


def _chunk(target, x, taps, mask):
    """(labels [b, T], top-k [b, T, TOPK], features [b, T, F] fp16) of the rows `x`, all on x's device."""
    T = x.shape[1]
    logits, hidden = target(x, torch.arange(T, device=x.device).expand_as(x), mask, taps=taps)
    top = logits.topk(TOPK, dim=-1).indices  # top-1 is the argmax
    topk = torch.cat((x[:, :1, None].expand(-1, 1, TOPK), top[:, :-1]), 1)  # the first token: itself only
    return topk[..., 0], topk, hidden.to(torch.float16)


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
        labels, topk, feats = _chunk(target, rows[i : i + batch].to(device), taps, mask)
        out["labels"][i : i + batch] = labels.cpu().numpy()
        out["topk"][i : i + batch] = topk.cpu().numpy()
        out["feats"][i : i + batch] = feats.cpu().numpy()
        for a in out.values():
            a.flush()
        progress["done"] = min(i + batch, S)
        _write_progress(path, progress)
        if log:
            log(progress["done"], S)
    return progress


@torch.no_grad()
def in_memory(tokens: torch.Tensor, lengths: torch.Tensor, target, taps, device, batch: int = 8, log=None):
    """The data of `tokens` built on `device`: the features stay there, labels and top-k come to the host (the
    sampled loss draws its candidates there)."""
    S, T = tokens.shape
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    labels, topk, feats = [], [], None
    for i in range(0, S, batch):
        lab, top, f = _chunk(target, tokens[i : i + batch].to(device), taps, mask)
        if feats is None:
            feats = torch.empty((S, T, f.shape[-1]), dtype=torch.float16, device=device)
        feats[i : i + batch] = f
        labels.append(lab.int().cpu())
        topk.append(top.int().cpu())
        if log:
            log(min(i + batch, S), S)
    return DrafterData(tokens, lengths, torch.cat(labels).numpy(), torch.cat(topk).numpy(), feats)


def load(path: Path) -> DrafterData:
    path = Path(path)
    progress = _progress(path)
    if progress["done"] < progress["rows"]:
        raise DtrtError(f"{path}: {progress['done']} of {progress['rows']} rows built; --resume finishes it")
    rows = torch.load(path / "rows.pt")
    arrays = _arrays(path, progress["rows"], progress["seq_len"], progress["feat_dim"], "r")
    return DrafterData(rows["tokens"], rows["lengths"], **arrays)

"""Training data for a drafter, made by the target itself: fixed-length rows of tokens, the target's greedy
token for every position (labels), and the target's tapped features, all from batched forwards.

Two sources: text (corpus files, teacher-forced: labels are the target's greedy predictions given the real
prefix) and the target's own greedy continuations of prompts (labels are the tokens themselves)."""

from dataclasses import dataclass
from pathlib import Path

import torch

from dtrt.errors import DtrtError
from dtrt.models.target import KVCache

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl")


@dataclass
class DrafterData:
    tokens: torch.Tensor  # Long [S, T]
    labels: torch.Tensor  # Long [S, T]: labels[:, t] is the target's greedy token at position t
    lengths: torch.Tensor  # Long [S]
    feats: torch.Tensor  # [S, T, taps*H], stored in fp16

    def __len__(self):
        return self.tokens.shape[0]

    def save(self, path: Path):
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: Path) -> "DrafterData":
        return cls(**torch.load(path))


def read_corpus(paths, max_chars: int) -> str:
    """Text of the given files or directories (recursively, text-like suffixes): an equal share of max_chars
    from each file, so that every source is represented."""
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise DtrtError(f"--corpus {p}: not found")
        files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise DtrtError(f"--corpus {', '.join(map(str, paths))}: no text files ({', '.join(TEXT_SUFFIXES)})")
    share = max_chars // len(files)
    return "\n".join(f.read_text(errors="ignore")[:share] for f in files)


def text_rows(tokenizer, text: str, T: int, max_rows: int) -> torch.Tensor:
    ids = []
    for i in range(0, len(text), 4096):  # pieces stay under the tokenizer's model_max_length
        ids += tokenizer.encode(text[i : i + 4096], add_special_tokens=False)
        if len(ids) >= T * max_rows:
            break
    n = min(len(ids) // T, max_rows)
    return torch.tensor(ids[: n * T], dtype=torch.long).reshape(n, T)


@torch.no_grad()
def greedy_labels_and_features(target, rows, batch: int, device, taps, log=None):
    """One batched causal forward per chunk of rows: (labels, features fp16 of the layers `taps`)."""
    S, T = rows.shape
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    labels = torch.empty_like(rows)
    feats = None
    for i in range(0, S, batch):
        x = rows[i : i + batch].to(device)
        logits, hidden = target(x, torch.arange(T, device=device).expand_as(x), mask, taps=taps)
        labels[i : i + batch, 0] = rows[i : i + batch, 0]
        labels[i : i + batch, 1:] = logits[:, :-1].argmax(-1).cpu()
        if feats is None:
            feats = torch.empty(S, T, hidden.shape[-1], dtype=torch.float16)
        feats[i : i + batch] = hidden.to(torch.float16).cpu()
        if log:
            log(min(i + batch, S), S)
    return labels, feats


class PaddedKV(KVCache):
    """A batch cache over left-padded rows: the new tokens never see another row's padding."""

    def __init__(self, cfg, capacity: int, valid, dtype, device):
        super().__init__(cfg, capacity, dtype, device, batch=(valid.shape[0],))
        self.valid = valid  # bool [b, capacity]

    def past_mask(self, mask):
        return self.valid[:, None, : self.past].expand(*mask.shape[:-1], self.past)

    def keep(self, rows):
        """Only `rows` (indices into the batch) from now on: finished rows stop costing compute."""
        self.k, self.v, self.valid = self.k[:, rows], self.v[:, rows], self.valid[rows]


@torch.no_grad()
def batched_decode(
    target,
    prompts: list[list[int]],
    new_tokens: int,
    stop: tuple = (),
    device="cpu",
    temperature: float = 0.0,
    top_p: float = 1.0,
    generators: list | None = None,
) -> list[list[int]]:
    """The target's continuation of each prompt, all rows decoded together (left padding): greedy for a row whose
    generator is None (or at temperature 0), else sampled with temperature and top-p from that row's own
    generator, so a sampled row is reproduced by its seed (with the same batch: rows share matrix products, which
    round alike only for the same shapes). A row ends at its first stop token (included) or after new_tokens;
    finished rows leave the batch."""
    from dtrt.runtime.sampling import target_probs

    b, L = len(prompts), max(map(len, prompts))
    generators = [None] * b if generators is None or temperature == 0 else list(generators)
    pad = torch.tensor([L - len(p) for p in prompts], device=device)
    ids = torch.zeros(b, L, dtype=torch.long, device=device)
    valid = torch.ones(b, L + new_tokens, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, pad[i] :] = torch.tensor(p)
        valid[i, : pad[i]] = False
    cache = PaddedKV(target.cfg, L + new_tokens, valid, target.dtype, device)
    positions = (torch.arange(L, device=device) - pad[:, None]).clamp(min=0)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    mask = (causal & valid[:, None, :L]) | torch.eye(L, dtype=torch.bool, device=device)  # pads see themselves
    stop = torch.tensor(stop, dtype=torch.long, device=device)
    out = [[] for _ in range(b)]
    rows = list(range(b))  # the prompts still in the batch, in batch order
    live = torch.ones(b, dtype=torch.bool, device=device)  # rows without a stop token yet
    for step in range(new_tokens):
        logits, _ = target(ids, positions, mask, cache, last=1)
        cache.past += ids.shape[1]
        ids = logits[:, -1].argmax(-1)
        alive = live.tolist()
        sampled = [j for j, r in enumerate(rows) if generators[r] is not None and alive[j]]
        if sampled:
            probs = target_probs(logits[sampled, -1], temperature, top_p).cpu()
            for k, j in enumerate(sampled):
                ids[j] = torch.multinomial(probs[k], 1, generator=generators[rows[j]]).item()
        for r, t, a in zip(rows, ids.tolist(), alive):
            if a:
                out[r].append(t)
        live &= ~torch.isin(ids, stop)
        if not live.any() or step == new_tokens - 1:
            break
        ids, positions = ids[:, None], positions[:, -1:] + 1
        if (~live).sum() * 8 >= len(rows):  # drop finished rows once they are an eighth of the batch
            keep = live.nonzero()[:, 0]
            cache.keep(keep)
            ids, positions, live = ids[keep], positions[keep], live[keep]
            rows = [rows[j] for j in keep.tolist()]
        mask = torch.ones(len(rows), 1, 1, dtype=torch.bool, device=device)
    return out


def batched_greedy(
    target, prompts: list[list[int]], new_tokens: int, stop: tuple = (), device="cpu"
) -> list[list[int]]:
    """The target's greedy continuation of each prompt (batched_decode at temperature 0)."""
    return batched_decode(target, prompts, new_tokens, stop, device)


def continuations(
    target, prompts: list[list[int]], new_tokens: int, T: int, stop: tuple = (), batch: int = 32, log=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the target's own greedy continuations (prompt tail + continuation, cut at a stop token, padded
    with the last token to T) and their valid lengths. Prompts are decoded in batches of similar length."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows, lengths = [None] * len(prompts), [0] * len(prompts)
    for s in range(0, len(order), batch):
        chunk = order[s : s + batch]
        heads = [prompts[i][-(T // 2) :] for i in chunk]
        for i, head, gen in zip(chunk, heads, batched_greedy(target, heads, new_tokens, stop)):
            cut = next((j + 1 for j, t in enumerate(gen) if t in stop), len(gen))
            seq = (head + gen[:cut])[:T]
            rows[i], lengths[i] = seq + [seq[-1]] * (T - len(seq)), len(seq)
        if log:
            log(min(s + batch, len(order)), len(order))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(lengths)

"""Training rows for a drafter, made by the target itself: fixed-length rows of tokens (what the target says of
them, labels and features, is computed into `dtrt.train.store`).

Two sources: text (corpus files, teacher-forced: labels are the target's greedy predictions given the real
prefix) and the target's own greedy continuations of prompts (labels are the tokens themselves). The decoders here
(batched with left padding; continuous batching over per-row cache slots, for `dtrt drafter-data`) are how the
target makes its own text fastest on a CPU."""

from collections import OrderedDict
from pathlib import Path

import torch

from dtrt.errors import DtrtError
from dtrt.models.target import KVCache
from dtrt.runtime.sampling import nucleus

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".jsonl")


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


def windows(rows: list[list[int]], starts: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-length rows [S, T] (padded with their last token) and valid lengths [S] from variable-length rows: each
    row's windows begin T // 2 tokens before its response (`starts`; 0 for text) and follow every T // 2 tokens
    until one reaches the row's end, so every response token has at least T // 2 tokens of context in one of
    them."""
    out, lengths = [], []
    for row, start in zip(rows, starts):
        s = max(0, start - T // 2)
        while True:
            w = row[s : s + T]
            out.append(w + [w[-1]] * (T - len(w)))
            lengths.append(len(w))
            if s + T >= len(row):
                break
            s += T // 2
    return torch.tensor(out, dtype=torch.long).reshape(-1, T), torch.tensor(lengths, dtype=torch.long)


def sample_rows(logits, temperature: float, top_p: float, generators) -> torch.Tensor:
    """Long[n]: one token per row of logits [n, V], sampled with temperature and top-p (dtrt.runtime.sampling's
    nucleus) from each row's own generator."""
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, (p, gen) in enumerate(zip(probs, generators)):
        mass, ids = nucleus(p, top_p)
        j = torch.multinomial(mass, 1, generator=gen)[0]
        out[i] = j if ids is None else ids[j]
    return out.to(logits.device)


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
def batched_greedy(
    target, prompts: list[list[int]], new_tokens: int, stop: tuple = (), device="cpu"
) -> list[list[int]]:
    """The target's greedy continuation of each prompt, all rows decoded together (left padding). A row ends at its
    first stop token (included) or after new_tokens; finished rows leave the batch."""
    b, L = len(prompts), max(map(len, prompts))
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
        for r, t, a in zip(rows, ids.tolist(), live.tolist()):
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


class SlotKV(KVCache):
    """A cache of rows that each hold their own sequence: row r's K/V in columns [0, length[r]). A decode step writes
    each row's new token at its own column, so a row can start (a new prompt in a finished row's slot) while the
    others continue."""

    def __init__(self, cfg, rows: int, capacity: int, dtype, device):
        super().__init__(cfg, capacity, dtype, device, batch=(rows,))
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.width = 0  # the past columns a step reads: the longest row's length

    def update(self, layer: int, k, v):
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[layer, rows, :, self.length, :] = k[:, :, 0, :]
        self.v[layer, rows, :, self.length, :] = v[:, :, 0, :]
        return self.k[layer, ..., : self.width + 1, :], self.v[layer, ..., : self.width + 1, :]

    def past_mask(self, mask):
        """Columns [0, width) a row sees: its own past and, for a row shorter than the longest, its new token (the
        step's mask column, index width, is then the row's stale column)."""
        cols = torch.arange(self.width, device=self.length.device)
        return (cols <= self.length[:, None])[:, None, :]

    def keep(self, rows):
        self.k, self.v, self.length = self.k[:, rows], self.v[:, rows], self.length[rows]


@torch.no_grad()
def decode_pool(
    target,
    queue,
    batch: int,
    new_tokens: int,
    capacity: int,
    done,
    stop: tuple = (),
    device="cpu",
    temperature: float = 0.0,
    top_p: float = 1.0,
):
    """Continuous batching: up to `batch` rows decode together and a finished row's slot takes the next prompt at
    once, so the batch stays full while there is work. `queue` (a deque) holds (key, prompt ids, generator or
    None: greedy); `done(key, tokens)` gets each row's tokens (cut after its first stop token, or new_tokens
    long) as it finishes, and may append work to the queue. Prompts must be shorter than capacity - new_tokens."""
    cache = SlotKV(target.cfg, batch, capacity, target.dtype, device)
    keys, gens, outs = [None] * batch, [None] * batch, [[] for _ in range(batch)]
    last = torch.zeros(batch, dtype=torch.long, device=device)  # each row's newest token

    def choose(logits, rows):
        """Each row's next token from logits [len(rows), V]: argmax, or a sample from the row's generator."""
        ids = logits.argmax(-1)
        sampled = [j for j, r in enumerate(rows) if gens[r] is not None and temperature > 0]
        if sampled:
            ids[sampled] = sample_rows(logits[sampled], temperature, top_p, [gens[rows[j]] for j in sampled])
        return ids

    def take(rows, ids):
        """Append each row's new token; finish rows at a stop token or the token limit."""
        for r, t in zip(rows, ids.tolist()):
            outs[r].append(t)
            last[r] = t
            if t in stop or len(outs[r]) >= new_tokens:
                done(keys[r], outs[r])
                keys[r] = None

    shared = OrderedDict()  # prompt -> (K, V, logits) of the latest prefills: a prompt's other samples reuse them

    def refill(rows):
        """The next prompts into free rows: one batched, left-padded prefill of the prompts not prefilled lately, its
        K/V moved to columns [0, len)."""
        work = [queue.popleft() for _ in rows[: len(queue)]]
        rows = rows[: len(work)]
        prompts = list({tuple(ids): ids for _, ids, _ in work if tuple(ids) not in shared}.values())
        if prompts:
            L = max(map(len, prompts))
            pad = [L - len(p) for p in prompts]
            ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
            valid = torch.ones(len(prompts), L, dtype=torch.bool, device=device)
            for j, p in enumerate(prompts):
                ids[j, pad[j] :] = torch.tensor(p)
                valid[j, : pad[j]] = False
            tmp = PaddedKV(target.cfg, L, valid, target.dtype, device)
            positions = (torch.arange(L, device=device) - torch.tensor(pad, device=device)[:, None]).clamp(min=0)
            causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
            mask = (causal & valid[:, None, :]) | torch.eye(L, dtype=torch.bool, device=device)
            logits, _ = target(ids, positions, mask, tmp, last=1)
            for j, p in enumerate(prompts):
                shared[tuple(p)] = (tmp.k[:, j, :, pad[j] :].clone(), tmp.v[:, j, :, pad[j] :].clone(), logits[j, -1])
        for r, (key, p, gen) in zip(rows, work):
            k, v, _ = shared[tuple(p)]
            cache.k[:, r, :, : len(p)] = k
            cache.v[:, r, :, : len(p)] = v
            cache.length[r] = len(p)
            keys[r], gens[r], outs[r] = key, gen, []
        first = torch.stack([shared[tuple(p)][2] for _, p, _ in work])
        while len(shared) > 8:
            shared.popitem(last=False)
        take(rows, choose(first, rows))

    rows_n = batch
    while True:
        free = [r for r in range(rows_n) if keys[r] is None]
        if queue and free:
            refill(free)
            continue
        live = [r for r in range(rows_n) if keys[r] is not None]
        if not live:
            return
        if len(live) < rows_n and (rows_n - len(live)) * 8 >= rows_n:  # no more work: drop the finished rows
            keep = torch.tensor(live, device=device)
            cache.keep(keep)
            last = last[keep]
            keys, gens, outs = [keys[r] for r in live], [gens[r] for r in live], [outs[r] for r in live]
            rows_n = len(live)
            continue
        cache.width = int(cache.length.max())
        mask = (cache.length == cache.width)[:, None, None]
        logits, _ = target(last[:, None], cache.length[:, None], mask, cache, last=1)
        cache.length += 1
        cache.length[[r for r in range(rows_n) if keys[r] is None]] = 0  # empty rows write column 0 until refilled
        take(live, choose(logits[live, -1], live))


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

"""`dtrt drafter-data`: a drafter's training data at scale, written in shards that a run resumes.

Rows are token sequences of two kinds:
- responses: the target's own answers to the prompts of a conversation file, generated in batches (greedy for
  sample 0, sampled with a seed per (prompt, sample) for the others), each row the prompt (the chat template,
  thinking off, with the target's earlier answers for a later turn) followed by the answer, cut after EOS;
- corpus: text cut into rows of a fixed number of tokens, to be teacher-forced.

Labels and features are not stored: `dtrt train-drafter --data DIR` recomputes them with the target.

DIR holds `responses-NNNNN.safetensors` and `corpus-NNNNN.safetensors` (each written under a temporary name and
renamed when complete) and `progress.json`, rewritten the same way after every shard: the target's and the
sources' fingerprints, the options that decide the rows, and the shards done. A killed run resumes after its
last finished shard; the work of every shard is fixed in advance, so the resumed run writes the rows an
uninterrupted run would have."""

import fcntl
import hashlib
import json
import os
import re
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dtrt.artifacts.files import sha256
from dtrt.artifacts.memo import checkpoint_hashes
from dtrt.errors import DtrtError
from dtrt.models.checkpoint import load_target
from dtrt.models.hybrid import HybridTarget
from dtrt.runtime.tokenizer import load_tokenizer
from dtrt.train.config import DataGenConfig
from dtrt.train.conversations import prompt_text, read_conversations
from dtrt.train.data import decode_pool, read_corpus, text_rows

FORMAT = "dtrt-drafter-data/1"
PROGRESS = "progress.json"
COLUMNS = ("offsets", "response_start", "prompt", "sample", "turn")


@dataclass
class Row:
    tokens: list[int]
    response_start: int  # where the target's answer begins (0 for a corpus row)
    prompt: int  # index of the conversation in the prompts file (-1 for a corpus row)
    sample: int  # 0 greedy, >= 1 sampled (-1 for a corpus row)
    turn: int  # which user turn the answer follows (-1 for a corpus row)


def unit_seed(seed: int, prompt: int, sample: int) -> int:
    """The sampling seed of one (prompt, sample) pair, the same whatever else the run holds."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{prompt}/{sample}".encode()).digest()[:8], "little") >> 1


# ---- shards ----------------------------------------------------------------------------------------------------


def write_shard(path: Path, rows: list[Row], meta: dict):
    """One shard: every row's tokens (int32, concatenated), offsets, and where each row came from; written under a
    temporary name and renamed into place."""
    lengths = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long)
    tensors = {
        "tokens": torch.tensor([t for r in rows for t in r.tokens], dtype=torch.int32),
        "offsets": torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
        **{c: torch.tensor([getattr(r, c) for r in rows], dtype=torch.long) for c in COLUMNS[1:]},
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": FORMAT, "meta": json.dumps(meta)})
    tmp.chmod(0o644)
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Row]:
    try:
        t = load_file(path)
    except (SafetensorError, OSError) as e:
        raise DtrtError(f"{path}: not a readable shard ({e}); remove it and resume the run that wrote it") from None
    tokens, offsets = t["tokens"].tolist(), t["offsets"].tolist()
    cols = {c: t[c].tolist() for c in COLUMNS[1:]}
    return [
        Row(tokens[offsets[i] : offsets[i + 1]], *(cols[c][i] for c in COLUMNS[1:])) for i in range(len(offsets) - 1)
    ]


def target_fingerprint(target_path: Path) -> dict:
    """sha256 of the target's config, weights and tokenizer files: rows are token ids of this target only."""
    target_path = Path(target_path)
    out = checkpoint_hashes(target_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target_path / name).is_file():
            out[name] = sha256(target_path / name)
    return out


def read_progress(path: Path) -> dict | None:
    f = Path(path) / PROGRESS
    if not f.is_file():
        return None
    try:
        progress = json.loads(f.read_text())
    except json.JSONDecodeError:
        raise DtrtError(f"{f}: not valid JSON; it is not a dtrt drafter-data directory") from None
    if not isinstance(progress, dict) or progress.get("format") != FORMAT:
        raise DtrtError(f"{f}: not a {FORMAT} progress file")
    return progress


def check_data(path, target_path) -> dict:
    """The progress record of a drafter-data directory made with this target."""
    path = Path(path)
    progress = read_progress(path) if path.is_dir() else None
    if progress is None:
        raise DtrtError(f"--data {path}: no {PROGRESS}; write the data with `dtrt drafter-data --out {path}`")
    if progress["target"]["fingerprint"] != target_fingerprint(target_path):
        raise DtrtError(
            f"--data {path}: made with the target {progress['target']['name']}, not {target_path}; its token ids "
            "mean nothing to this target"
        )
    return progress


def load_rows(path, target_path) -> tuple[list[Row], dict]:
    """Every finished shard's rows of a drafter-data directory made with this target, and its progress record."""
    path = Path(path)
    progress = check_data(path, target_path)
    rows = []
    for kind in ("corpus", "responses"):
        for shard in progress[kind]["shards"]:
            rows += read_shard(path / shard["file"])
    return rows, progress


# ---- the run ---------------------------------------------------------------------------------------------------


def _ours(name: str, resume: bool) -> bool:
    """A file a run writes: with --resume, a first run killed before its first progress file left only these."""
    return name == ".lock" or resume and (".tmp-" in name or re.fullmatch(r"(responses|corpus)-\d+\.safetensors", name))


def _write_progress(out: Path, progress: dict):
    tmp = out / f".{PROGRESS}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(progress, indent=1) + "\n")
    os.replace(tmp, out / PROGRESS)


def _lock(out: Path):
    f = open(out / ".lock", "w")  # held open (and locked) for the whole run
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DtrtError(f"--out {out}: another dtrt drafter-data run is writing it") from None
    return f


def _check_resume(progress: dict, fresh: dict, out: Path):
    """A resumed run must be the run it continues: same target, sources and row options."""
    if progress["target"]["fingerprint"] != fresh["target"]["fingerprint"]:
        raise DtrtError(
            f"--resume {out}: this data was made with the target {progress['target']['name']}, not "
            f"{fresh['target']['name']}; choose another --out"
        )
    for kind, flag in (("prompts", "--prompts"), ("corpus", "--corpus")):
        was, now = (
            {k: v for k, v in (src or {}).items() if k != "name"}
            for src in (progress["sources"][kind], fresh["sources"][kind])
        )
        if was != now:  # the same content, wherever it lies now
            raise DtrtError(
                f"--resume {out}: {flag} differs from the run being resumed "
                f"({(progress['sources'][kind] or {}).get('name', 'none')}); give the same files or another --out"
            )
    for k, v in progress["options"].items():
        if fresh["options"].get(k) != v:
            raise DtrtError(
                f"--resume {out}: --{k.replace('_', '-')} was {v} in the run being resumed, now "
                f"{fresh['options'].get(k)}; keep it to continue the same rows"
            )


def generate_rows(target, tokenizer, convs, units, cfg: DataGenConfig, stop) -> tuple[list[Row], int]:
    """The rows of (prompt, sample) units, decoded with continuous batching in unit order; when a conversation's
    turn ends, its next turn (continuing from the target's own answers) joins the queue. Returns the rows (in unit
    order, then turn) and how many turns were skipped for a prompt over max_prompt_tokens."""
    gens = {u: torch.Generator().manual_seed(unit_seed(cfg.seed, *u)) if u[1] > 0 else None for u in units}
    answers = {u: [] for u in units}
    rows, skipped, queue = [], 0, deque()

    def ask(u):
        nonlocal skipped
        ids = tokenizer.encode(prompt_text(tokenizer, convs[u[0]], answers[u], cfg.chat), add_special_tokens=False)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
        else:
            queue.append(((u, ids), ids, gens[u]))

    def done(key, gen):
        u, ids = key
        rows.append(Row(ids + gen, len(ids), u[0], u[1], len(answers[u])))
        answers[u].append(tokenizer.decode(gen[:-1] if gen[-1] in stop else gen, skip_special_tokens=True))
        if len(answers[u]) < len(convs[u[0]].turns):
            ask(u)

    for u in units:
        ask(u)
    capacity = cfg.max_prompt_tokens + cfg.max_new_tokens
    decode_pool(
        target, queue, cfg.batch, cfg.max_new_tokens, capacity, done, stop, cfg.device, cfg.temperature, cfg.top_p
    )
    rows.sort(key=lambda r: (r.prompt, r.sample, r.turn))
    return rows, skipped


def drafter_data(
    target_path: Path,
    out: Path,
    cfg: DataGenConfig,
    prompts_file=None,
    corpus=(),
    resume: bool = False,
    name: str | None = None,
    log=print,
    max_shards: int | None = None,
) -> dict:
    """Write (or continue) the shards of `out`; returns the progress record. `max_shards`: stop after writing that
    many shards in this call (the run stays resumable)."""
    out, target_path = Path(out), Path(target_path)
    if not prompts_file and not corpus:
        raise DtrtError("no data to make: give --prompts FILE and/or --corpus PATH")
    progress = read_progress(out) if out.is_dir() else None
    if progress is not None and not resume:
        raise DtrtError(f"--out {out}: already holds drafter data; pass --resume to continue it, or another --out")
    if progress is None and out.is_dir() and any(not _ours(p.name, resume) for p in out.iterdir()):
        raise DtrtError(f"--out {out}: not empty and holds no drafter data ({PROGRESS}); choose another --out")

    convs = read_conversations(prompts_file) if prompts_file else []
    tokenizer = load_tokenizer(target_path)
    no_template = cfg.chat and not getattr(tokenizer, "chat_template", None)
    if no_template:
        cfg = DataGenConfig(**{**asdict(cfg), "chat": False})
    text = read_corpus(corpus, cfg.corpus_chars) if corpus else None
    fresh = {
        "format": FORMAT,
        "target": {"name": name or str(target_path), "fingerprint": target_fingerprint(target_path)},
        "sources": {
            "prompts": {
                "name": str(prompts_file),
                "sha256": sha256(Path(prompts_file)),
                "conversations": len(convs),
                "turns": sum(len(c.turns) for c in convs),
            }
            if prompts_file
            else None,
            "corpus": {
                "name": ", ".join(map(str, corpus)),
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "chars": len(text),
            }
            if corpus
            else None,
        },
        "options": cfg.row_options(),
        "corpus": {"rows": 0, "tokens": 0, "shards": []},
        "responses": {
            "units": len(convs) * cfg.samples,
            "done_units": 0,
            "rows": 0,
            "response_tokens": 0,
            "tokens": 0,
            "skipped_turns": 0,
            "seconds": 0.0,
            "shards": [],
        },
    }
    if progress is not None:
        _check_resume(progress, fresh, out)
    else:
        progress = fresh
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    if no_template:
        log(f"{target_path}: no chat template; prompts are used as plain text")
    try:
        for f in out.glob(".*.tmp-*"):  # a killed run's unfinished shard or progress file
            f.unlink()
        return _run(target_path, out, cfg, convs, text, tokenizer, progress, log, max_shards)
    finally:
        lock.close()


def _run(target_path, out, cfg, convs, text, tokenizer, progress, log, max_shards) -> dict:
    from dtrt.runtime.pipeline import stop_ids

    written = 0
    if text is not None:
        rows = text_rows(tokenizer, text, cfg.corpus_row_tokens, len(text))  # every full row of the text
        c = progress["corpus"]
        for k in range(len(c["shards"]), -(-rows.shape[0] // cfg.shard_rows)):
            if max_shards is not None and written >= max_shards:
                return progress
            chunk = rows[k * cfg.shard_rows : (k + 1) * cfg.shard_rows]
            shard = f"corpus-{k:05d}.safetensors"
            write_shard(out / shard, [Row(r, 0, -1, -1, -1) for r in chunk.tolist()], {"rows": chunk.shape[0]})
            c["shards"].append({"file": shard, "rows": chunk.shape[0], "tokens": chunk.numel()})
            c["rows"] += chunk.shape[0]
            c["tokens"] += chunk.numel()
            _write_progress(out, progress)
            written += 1
        log(f"corpus: {c['rows']} rows of {cfg.corpus_row_tokens} tokens")

    r = progress["responses"]
    units = [(i, s) for i in range(len(convs)) for s in range(cfg.samples)]
    n_shards = -(-len(units) // cfg.shard_rows)
    if len(r["shards"]) >= n_shards:
        return progress
    target = load_target(target_path).to(cfg.device)
    if isinstance(target, HybridTarget):
        raise DtrtError(f"{target_path}: dtrt drafter-data decodes dense targets (Qwen3, Llama) only, not hybrids")
    stop = stop_ids(target.cfg.eos_token_id, tokenizer, target_path)
    for k in range(len(r["shards"]), n_shards):
        if max_shards is not None and written >= max_shards:
            break
        t0 = time.perf_counter()
        a, b = k * cfg.shard_rows, min((k + 1) * cfg.shard_rows, len(units))
        rows, skipped = generate_rows(target, tokenizer, convs, units[a:b], cfg, stop)
        seconds = time.perf_counter() - t0
        shard = f"responses-{k:05d}.safetensors"
        answer = sum(len(x.tokens) - x.response_start for x in rows)
        write_shard(out / shard, rows, {"units": [a, b]})
        r["shards"].append(
            {
                "file": shard,
                "units": [a, b],
                "rows": len(rows),
                "tokens": sum(len(x.tokens) for x in rows),
                "response_tokens": answer,
                "skipped_turns": skipped,
                "seconds": round(seconds, 2),
            }
        )
        r["done_units"] = b
        r["rows"] += len(rows)
        r["tokens"] += r["shards"][-1]["tokens"]
        r["response_tokens"] += answer
        r["skipped_turns"] += skipped
        r["seconds"] = round(r["seconds"] + seconds, 2)
        _write_progress(out, progress)
        written += 1
        log(
            f"responses shard {k + 1}/{n_shards}: {len(rows)} rows, {answer} response tokens in {seconds:.0f}s "
            f"({answer / seconds:.1f} tok/s); total {r['response_tokens']:,} response tokens, "
            f"{r['response_tokens'] / r['seconds']:.1f} tok/s"
        )
    return progress

"""`dtrt quality`: what a target quantization costs, on held-out text from the bench datasets (never training data).

Each text (HumanEval: a task's prompt and canonical solution; MT-Bench: a question's turns and its reference answer
where it has one) is cut to `max_tokens` tokens and scored by each export's target stage in one call, as the
runtime runs it (int8 activations on a quantized target). Per quantization and dataset:

- agreement: the share of positions where its greedy next token (argmax) equals the full-precision target's, the
  first quantization given being the reference;
- nll: the mean negative log-likelihood per token of the text (nats), and its perplexity.
"""

import gzip
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from dtrt.artifacts.export import Export
from dtrt.bench.datasets import _read
from dtrt.errors import DtrtError
from dtrt.runtime.backends.onnxruntime import cpu_session

TEXT_DATASETS = ("humaneval", "mt-bench")


@dataclass(frozen=True)
class Text:
    dataset: str
    id: str
    text: str


def held_out(name: str, n: int, seed: int = 0) -> list[Text]:
    """`n` texts of dataset `name` (a seeded random subset)."""
    if name not in TEXT_DATASETS:
        raise DtrtError(f"--datasets {name!r}: dtrt quality scores text of {', '.join(TEXT_DATASETS)}")
    raw = _read(name)
    if name == "humaneval":
        rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
        texts = [Text(name, r["task_id"], r["prompt"] + r["canonical_solution"]) for r in rows]
    else:
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        texts = [Text(name, str(r["question_id"]), "\n\n".join([*r["turns"], *r.get("reference", [])])) for r in rows]
    order = np.random.default_rng(seed).permutation(len(texts))
    return [texts[i] for i in order[:n]]


def score(sess, exp: Export, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, nll) at every position but the last: the target's greedy next token and -log p(the text's next)."""
    t = exp.manifest["target"]
    n = len(ids)
    empty = np.zeros((t["num_layers"], t["num_kv_heads"], 0, t["head_dim"]), np.float32)
    feeds = {
        "ids": np.asarray(ids, np.int64),
        "positions": np.arange(n, dtype=np.int64),
        "mask": np.tril(np.ones((n, n), bool)),
        "past_k": empty,
        "past_v": empty,
        "past_positions": np.zeros(0, np.int64),
    }
    logits = torch.from_numpy(sess.run(["logits"], feeds)[0][:-1]).double()
    nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logits.argmax(-1).numpy(), nll.numpy()


def quality(exports: dict[str, Export], texts: list[Text], tokenizer, *, max_tokens: int, threads: int | None):
    """Rows per (quantization, dataset): texts, tokens scored, agreement with the first export, nll, perplexity."""
    for exp in exports.values():
        if "state" in exp.manifest["stages"]["target"]["inputs"]:
            raise DtrtError(f"--export {exp.path}: a hybrid target; dtrt quality scores attention-only targets")
        max_tokens = min(max_tokens, exp.max_context)
    sessions = {name: cpu_session(exp.stage("target"), threads) for name, exp in exports.items()}
    reference = next(iter(exports))
    totals: dict[tuple[str, str], dict] = {}
    for text in texts:
        ids = tokenizer.encode(text.text, add_special_tokens=False)[:max_tokens]
        if len(ids) < 2:
            continue
        scored = {name: score(sess, exports[name], ids) for name, sess in sessions.items()}
        for name, (argmax, nll) in scored.items():
            acc = totals.setdefault((name, text.dataset), {"texts": 0, "tokens": 0, "agree": 0, "nll": 0.0})
            acc["texts"] += 1
            acc["tokens"] += len(nll)
            acc["agree"] += int((argmax == scored[reference][0]).sum())
            acc["nll"] += float(nll.sum())
    rows = []
    for (name, dataset), acc in totals.items():
        nll = acc["nll"] / acc["tokens"]
        rows.append(
            {
                "quant": name,
                "dataset": dataset,
                "texts": acc["texts"],
                "tokens": acc["tokens"],
                "agreement": acc["agree"] / acc["tokens"],
                "nll": nll,
                "perplexity": math.exp(nll),
            }
        )
    return rows


def table(rows: list[dict], reference: str) -> str:
    lines = [
        f"| quant | dataset | texts | tokens | agreement with {reference} | nll (nats/token) | perplexity |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['quant']} | {r['dataset']} | {r['texts']} | {r['tokens']} | {r['agreement']:.4f} | "
            f"{r['nll']:.4f} | {r['perplexity']:.3f} |"
        )
    return "\n".join(lines)

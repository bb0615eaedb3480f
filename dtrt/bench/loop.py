"""The benchmark loop: every contender on every prompt, interleaved, so machine noise hits all methods alike.

Each finished record is handed to `keep` at once (the bench appends it to records.jsonl), and records already
kept by an interrupted run are not redone: a multi-turn prompt resumes from the contender's own recorded answers. A
peer contender that fails (dtrt.bench.peer) loses its row, with the reason, and the other contenders go on."""

from dataclasses import replace

from dtrt.bench.contenders import render
from dtrt.bench.datasets import Prompt
from dtrt.bench.peer import PeerFailed
from dtrt.bench.report import lookup_share
from dtrt.frontend.requests import Request
from dtrt.runtime.sampling import SamplingConfig

WARMUP_PROMPT, WARMUP_TOKENS = "Warmup", 16


def record_key(r: dict) -> tuple:
    return r["temperature"], r["dataset"], r["prompt_id"], r["turn"], r["method"]


def warm_up(contenders, log, thinking: bool = False, failed: dict | None = None):
    """One short generation per contender before any timing (first-call allocations, CaDDTree's cost curve); a peer
    that fails here goes into `failed` (label -> why)."""
    for e in contenders:
        log(f"warm-up {e.label}")
        try:
            e.generate(render(e.tokenizer, [], WARMUP_PROMPT, thinking), WARMUP_TOKENS, SamplingConfig())
        except PeerFailed as why:
            _lost(e, why, failed, log)


def _lost(contender, why, failed: dict | None, log):
    log(f"{contender.label} row failed: {why}")
    if failed is not None:
        failed[contender.label] = str(why)


def run(
    contenders,
    prompts: dict[str, list[Prompt]],
    requests: list[Request],
    log,
    keep=None,
    done: dict | None = None,
    failed: dict | None = None,
) -> list[dict]:
    """One record per (request, i.e. temperature; dataset, prompt, turn, contender). Contenders take turns in an order
    rotated from prompt to prompt; on a multi-turn prompt each contender continues from its own earlier answers.
    `done`: record key -> record of an earlier run, reused instead of generated; `keep(record)` is called for every
    new record; `failed` (label -> why) collects the peers lost on the way."""
    done, failed = done or {}, failed if failed is not None else {}
    records = []
    for req in requests:
        temperature, seed = req.sampling.temperature, req.sampling.seed
        for dataset, items in prompts.items():
            for i, prompt in enumerate(items):
                history = {e.label: [] for e in contenders}
                for turn, user in enumerate(prompt.turns):
                    # one seed per prompt and turn, shared by every contender
                    sampling = replace(req.sampling, seed=seed * 1_000_003 + 1000 * i + turn)
                    k = (i + turn) % len(contenders)
                    for e in contenders[k:] + contenders[:k]:
                        if e.label in failed:
                            continue
                        key = (temperature, dataset, prompt.id, turn, e.label)
                        if key in done:
                            rec = done[key]
                        else:
                            text = render(e.tokenizer, history[e.label], user, req.thinking)
                            try:
                                rec = e.generate(text, req.max_new_tokens, sampling)
                            except PeerFailed as why:
                                _lost(e, why, failed, log)
                                continue
                            annotate(rec, e, dataset, prompt.id, turn, temperature)
                            if keep is not None:
                                keep(rec)
                            log(
                                f"[T={temperature:g}] {dataset} {i + 1}/{len(items)}"
                                f"{f' turn {turn + 1}' if len(prompt.turns) > 1 else ''} {e.label}: "
                                f"tau {rec['tau']:.2f}  {rec['tokens_per_s']:.1f} tok/s  {rec['n_tokens']} tokens"
                            )
                        history[e.label].append((user, rec["text"]))
                        records.append(rec)
    return records


def annotate(rec: dict, contender, dataset: str, prompt_id, turn: int, temperature: float):
    n = len(rec["tokens"])
    rec.update(
        dataset=dataset,
        prompt_id=prompt_id,
        turn=turn,
        temperature=temperature,
        method=contender.label,
        base_method=contender.method,
        budget=contender.budget,
        quant=contender.quant,
        captured=getattr(contender, "captured", False),
        compiled=getattr(contender, "compiled", False),
        builder=getattr(contender, "builder", None),
        draft_graph=getattr(contender, "draft_graph", False),
        n_tokens=n,
        tokens_per_s=n / rec["decode_s"] if rec["decode_s"] > 0 else 0.0,
        tpot_s=rec["decode_s"] / n if n else 0.0,
        # None where the contender's trees hold no lookup nodes (ar, dominotree without --lookup, a peer)
        lookup_share=lookup_share(rec["accepted"], rec["from_lookup"]) if getattr(contender, "lookup", False) else None,
    )

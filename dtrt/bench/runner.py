"""The benchmark loop: every engine on every prompt, interleaved, so machine noise hits all methods alike."""

from dataclasses import replace

from dtrt.bench.datasets import Prompt
from dtrt.bench.engines import render
from dtrt.runtime.requests import Request
from dtrt.runtime.sampling import SamplingConfig

WARMUP_PROMPT, WARMUP_TOKENS = "Warmup", 16


def warm_up(engines, log, thinking: bool = False):
    """One short generation per engine before any timing (first-call allocations, CaDDTree's cost curve)."""
    for e in engines:
        log(f"warm-up {e.label}")
        e.generate(render(e.tokenizer, [], WARMUP_PROMPT, thinking), WARMUP_TOKENS, SamplingConfig())


def run(engines, prompts: dict[str, list[Prompt]], requests: list[Request], log) -> list[dict]:
    """One record per (request, i.e. temperature; dataset, prompt, turn, engine). Engines take turns in an order
    rotated from prompt to prompt; on a multi-turn prompt each engine continues from its own earlier answers."""
    records = []
    for req in requests:
        temperature, seed = req.sampling.temperature, req.sampling.seed
        for dataset, items in prompts.items():
            for i, prompt in enumerate(items):
                history = {e.label: [] for e in engines}
                for turn, user in enumerate(prompt.turns):
                    # one seed per prompt and turn, shared by every engine
                    sampling = replace(req.sampling, seed=seed * 1_000_003 + 1000 * i + turn)
                    k = (i + turn) % len(engines)
                    for e in engines[k:] + engines[:k]:
                        text = render(e.tokenizer, history[e.label], user, req.thinking)
                        rec = e.generate(text, req.max_new_tokens, sampling)
                        history[e.label].append((user, rec["text"]))
                        n = len(rec["tokens"])
                        rec.update(
                            dataset=dataset,
                            prompt_id=prompt.id,
                            turn=turn,
                            temperature=temperature,
                            method=e.label,
                            base_method=e.method,
                            budget=e.budget,
                            n_tokens=n,
                            tokens_per_s=n / rec["decode_s"] if rec["decode_s"] > 0 else 0.0,
                            tpot_s=rec["decode_s"] / n if n else 0.0,
                        )
                        records.append(rec)
                        log(
                            f"[T={temperature:g}] {dataset} {i + 1}/{len(items)}"
                            f"{f' turn {turn + 1}' if len(prompt.turns) > 1 else ''} {e.label}: "
                            f"tau {rec['tau']:.2f}  {rec['tokens_per_s']:.1f} tok/s  {n} tokens"
                        )
    return records

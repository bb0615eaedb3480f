"""`dtrt quality`: what a target configuration costs in quality, against a reference, on held-out prompts and text
from the bench datasets (never training data). With `--model` the reference is the fp32 PyTorch target of the
checkpoint (the truth every stage is checked against); with `--export` dirs, the first export.

Per configuration and dataset:

- teacher-forced (texts: HumanEval's prompt and canonical solution, MT-Bench's turns and reference answer, each cut
  to `max_tokens`, scored in one call as the runtime runs the target):
  agreement, the share of positions whose greedy next token equals the reference's; nll, the mean negative
  log-likelihood per token of the text (nats), with its difference from the reference's;
- free-running (prompts: the bench's first turns through the chat template, greedy AR for `max_new_tokens`):
  identical, the share of answers the same as the reference's over their first `QualityGate.first` tokens;
  loops, the answers that fall into a repetition loop (dtrt.zoo.gate.loops), and new_loops, those whose reference
  answer does not; the AR tokens per second of those generations.

A configuration is `none` (the fp32 export), `gguf`, `gguf-a8` (the GGUF file's own blocks at fp32 and int8
activations: dtrt.exporter.gguf_target), `int8`, `int4` (their int8-activation kernels, as `dtrt run` runs
them), or `int8-fp32act`/`int4-fp32act` (the same weights with fp32 activations: MatMulNBits accuracy level 1;
teacher-forced only, since the runtime does not run them). `kernel_path` other than `native` measures the
configurations in a child process on that CPU kernel path (dtrt.artifacts.kernel_path); the reference stays here.
A peer, llama.cpp on a GGUF of the same target (dtrt.bench.quality_llamacpp), is measured on the same token ids and
compared by the same functions; its rows are shown beside the others, not gated.
"""

import gzip
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dtrt.artifacts.kernel_path import emulated_command, this_path
from dtrt.bench.datasets import read_dataset
from dtrt.errors import DtrtError
from dtrt.runtime.backends.kv import past_feeds
from dtrt.runtime.backends.onnxruntime import MATMUL_ACCURACY, OrtRunner
from dtrt.zoo.gate import GATE, loops, same_start

TEXT_DATASETS = ("humaneval", "mt-bench")
# configuration suffix -> MatMulNBits accuracy level: the runtime's (int8 activations), or fp32 activations
ACCURACY = {"": MATMUL_ACCURACY, "-fp32act": 1}


@dataclass(frozen=True)
class Text:
    dataset: str
    id: str
    text: str


@dataclass(frozen=True)
class Candidate:
    """One configuration to measure: an export (None: the fp32 PyTorch target at `target`) at a MatMulNBits
    accuracy level; `free`: whether its free-running answers are generated."""

    name: str
    export: str | None = None
    target: str | None = None
    accuracy: int = 4
    free: bool = True


def parse_config(name: str) -> tuple[str, int]:
    """`int8-fp32act` -> ("int8", 1); `int8` -> ("int8", MATMUL_ACCURACY)."""
    for suffix, level in sorted(ACCURACY.items(), key=lambda kv: -len(kv[0])):
        if suffix and name.endswith(suffix):
            return name[: -len(suffix)], level
    return name, ACCURACY[""]


def config_candidate(name: str, export: str) -> Candidate:
    """The candidate of configuration `name` over its export: free-running only at the accuracy the runtime runs."""
    _, accuracy = parse_config(name)
    return Candidate(name, export=export, accuracy=accuracy, free=accuracy == MATMUL_ACCURACY)


def held_out(name: str, n: int, seed: int = 0) -> list[Text]:
    """`n` texts of dataset `name` (a seeded random subset)."""
    if name not in TEXT_DATASETS:
        raise DtrtError(f"--datasets {name!r}: dtrt quality scores text of {', '.join(TEXT_DATASETS)}")
    raw = read_dataset(name)
    if name == "humaneval":
        rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
        texts = [Text(name, r["task_id"], r["prompt"] + r["canonical_solution"]) for r in rows]
    else:
        rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        texts = [Text(name, str(r["question_id"]), "\n\n".join([*r["turns"], *r.get("reference", [])])) for r in rows]
    order = np.random.default_rng(seed).permutation(len(texts))
    return [texts[i] for i in order[:n]]


def score(runner, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, nll) at every position but the last: the target's greedy next token and -log p(the text's next)."""
    t = runner.export.manifest["target"]
    n = len(ids)
    empty = torch.zeros(t["num_layers"], t["num_kv_heads"], 0, t["head_dim"])
    out = runner(
        "target",
        ids=ids,
        positions=torch.arange(n),
        mask=torch.ones(n, n, dtype=torch.bool).tril(),
        **past_feeds(empty, empty, 0),
    )
    return _argmax_nll(out["logits"], ids)


def _argmax_nll(logits: torch.Tensor, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    logits = logits[:-1].double()
    nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logits.argmax(-1).numpy(), nll.numpy()


def _scorer(cand: Candidate, threads: int | None):
    """ids -> (argmax, nll) for the candidate's target."""
    if cand.export is None:
        from dtrt.models.checkpoint import load_target

        model = load_target(cand.target).eval()

        @torch.no_grad()
        def run(ids):
            n = len(ids)
            logits, _ = model(torch.tensor(ids), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
            return _argmax_nll(logits, ids)

        return run
    from dtrt.artifacts.export import load_export

    exp = load_export(cand.export)
    if "state" in exp.manifest["stages"]["target"]["inputs"]:
        raise DtrtError(f"--export {exp.path}: a hybrid target; dtrt quality scores attention-only targets")
    runner = OrtRunner(exp, threads, accuracy=cand.accuracy)
    runner.open("target")
    return lambda ids: score(runner, ids)


def _pipeline(cand: Candidate, threads: int | None):
    from dtrt.launch import resolve_spec
    from dtrt.launch.start import pipeline

    if cand.export is None:
        return pipeline(resolve_spec(target=cand.target, backend="torch", method="ar", threads=threads))
    return pipeline(resolve_spec(export=cand.export, backend="onnxruntime", method="ar", threads=threads))


def measure(
    cand: Candidate, seqs: list[list[int]], prompts: list[list[int]], *, max_new_tokens: int, threads: int | None
) -> dict:
    """The candidate's greedy argmax and NLL on each text (`seqs`), and its greedy AR answer to each prompt (token
    ids; none where `cand.free` is off), with their tokens per second and the ISA torch detects in this process."""
    from dtrt.runtime.sampling import SamplingConfig

    if threads:
        torch.set_num_threads(threads)
    run = _scorer(cand, threads)
    scored = [run(ids) for ids in seqs]
    answers, tokens, seconds = [], 0, 0.0
    if cand.free and prompts:
        pipe = _pipeline(cand, threads)
        for ids in prompts:
            out = pipe.generate(ids, max_new_tokens, SamplingConfig())
            answers.append(out.tokens)
            tokens, seconds = tokens + len(out.tokens) - 1, seconds + out.decode_s
    return {
        "name": cand.name,
        "argmax": [a.tolist() for a, _ in scored],
        "nll": [n.tolist() for _, n in scored],
        "answers": answers,
        "tok_s": tokens / seconds if seconds > 0 else None,
        "isa": torch.backends.cpu.get_cpu_capability(),
    }


def measure_on_path(
    path: str, cand: Candidate, seqs, prompts, *, max_new_tokens: int, threads: int | None, log=None
) -> dict:
    """measure() on CPU kernel path `path`: here for `native`, else in a child process under emulation."""
    if path == "native":
        return measure(cand, seqs, prompts, max_new_tokens=max_new_tokens, threads=threads)
    try:
        command, env = emulated_command(path, ["-m", "dtrt.bench.quality"])
    except ValueError as e:
        raise DtrtError(f"--kernel-path {path}: {e}") from None
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        args = {"max_new_tokens": max_new_tokens, "threads": threads}
        request.write_text(json.dumps({"candidate": asdict(cand), "seqs": seqs, "prompts": prompts, **args}))
        if log:
            log(f"measuring {cand.name} on kernel path {path} (emulated: about 150x slower)")
        done = subprocess.run([*command, str(request), str(result)], env=env, capture_output=True, text=True)
        if done.returncode != 0 or not result.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise DtrtError(f"--kernel-path {path}: the measurement of {cand.name} failed ({last})")
        return json.loads(result.read_text())


def compare(ref: dict, got: dict, datasets: list[str], prompt_sets: list[str], kernel_path: str) -> list[dict]:
    """One row per dataset: `got` against `ref` (both from measure(); `datasets`/`prompt_sets`: the dataset of each
    text and each prompt)."""
    rows = []
    for dataset in dict.fromkeys([*datasets, *prompt_sets]):
        idx = [i for i, d in enumerate(datasets) if d == dataset]
        tokens = sum(len(got["nll"][i]) for i in idx)
        agree = sum(int(np.sum(np.asarray(got["argmax"][i]) == np.asarray(ref["argmax"][i]))) for i in idx)
        nll = sum(float(np.sum(got["nll"][i])) for i in idx) / max(tokens, 1)
        ref_nll = sum(float(np.sum(ref["nll"][i])) for i in idx) / max(tokens, 1)
        row = {
            "quant": got["name"],
            "dataset": dataset,
            "kernel_path": kernel_path,
            "isa": got["isa"],
            "texts": len(idx),
            "tokens": tokens,
            "agreement": agree / tokens if tokens else float("nan"),
            "nll": nll,
            "nll_delta": nll - ref_nll,
            "perplexity": math.exp(nll),
            "answers": 0,
        }
        pidx = [i for i, d in enumerate(prompt_sets) if d == dataset]
        if got["answers"] and pidx:
            mine, theirs = [got["answers"][i] for i in pidx], [ref["answers"][i] for i in pidx]
            looping = [loops(a) for a in mine]
            row |= {
                "answers": len(pidx),
                "identical": sum(same_start(a, b, GATE.first) for a, b in zip(mine, theirs)) / len(pidx),
                "loops": sum(looping),
                "new_loops": sum(lp and not loops(b) for lp, b in zip(looping, theirs)),
                "ar_tok_s": got["tok_s"],
            }
        rows.append(row | {"gate": GATE.failures(row)})
    return rows


def quality(
    reference: Candidate,
    candidates: list[Candidate],
    texts: list[Text],
    prompts: list[tuple[str, str]],
    tokenizer,
    *,
    max_tokens: int,
    max_new_tokens: int,
    threads: int | None,
    kernel_paths: tuple[str, ...] = ("native",),
    peer=None,
    log=None,
) -> list[dict]:
    """Rows per (configuration, kernel path, dataset) against the reference, which is measured natively.
    `prompts`: (dataset, rendered prompt text), each cut to its last `max_tokens` tokens. `peer`: (seqs, prompt ids,
    max_new_tokens) -> measure()'s dict of another implementation (dtrt.bench.quality_llamacpp) or None; its rows
    come last, shown but not gated (`gated` false)."""
    seqs = [tokenizer.encode(t.text, add_special_tokens=False)[:max_tokens] for t in texts]
    keep = [i for i, ids in enumerate(seqs) if len(ids) >= 2]
    seqs, datasets = [seqs[i] for i in keep], [texts[i].dataset for i in keep]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False)[-max_tokens:] for _, p in prompts]
    prompt_sets = [d for d, _ in prompts]
    args = {"max_new_tokens": max_new_tokens, "threads": threads}
    if log:
        log(f"measuring the reference ({reference.name}) on this machine's kernel path ({this_path()})")
    ref = measure(reference, seqs, prompt_ids, **args)
    rows = []
    for path in kernel_paths:
        for cand in candidates:
            if cand == reference and path == "native":
                got = ref
            else:
                if log:
                    log(f"measuring {cand.name} ({path})")
                got = measure_on_path(path, cand, seqs, prompt_ids if cand.free else [], log=log, **args)
            label = this_path() if path == "native" else f"{path} (emulated)"
            rows += compare(ref, got, datasets, prompt_sets, label)
    got = peer(seqs, prompt_ids, max_new_tokens) if peer else None
    if got is not None:
        # its path: the peer's own build (MLAS's kernel path says nothing of llama.cpp's)
        rows += [r | {"gated": False} for r in compare(ref, got, datasets, prompt_sets, got["isa"])]
    return rows


def table(rows: list[dict], reference: str) -> str:
    lines = [
        f"| quant | path | dataset | texts | tokens | agreement with {reference} | nll (nats/token) | nll delta | "
        "answers | identical | loops (new) | AR tok/s | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        free = (
            f"{r['answers']} | {r['identical']:.2f} | {r['loops']} ({r['new_loops']}) | "
            + (f"{r['ar_tok_s']:.1f}" if r["ar_tok_s"] else "-")
            if r["answers"]
            else "- | - | - | -"
        )
        verdict = "pass" if not r["gate"] else "fail: " + "; ".join(r["gate"])
        if not r.get("gated", True):
            verdict = f"not gated ({'would ' + verdict if r['gate'] else 'would pass'})"
        lines.append(
            f"| {r['quant']} | {r['kernel_path']} | {r['dataset']} | {r['texts']} | {r['tokens']} | "
            f"{r['agreement']:.4f} | {r['nll']:.4f} | {r['nll_delta']:+.4f} | {free} | {verdict} |"
        )
    return "\n".join(lines)


def _child(request: str, result: str):
    """The child process of measure_on_path: one measure() from a request file into a result file."""
    req = json.loads(Path(request).read_text())
    out = measure(
        Candidate(**req["candidate"]),
        req["seqs"],
        req["prompts"],
        max_new_tokens=req["max_new_tokens"],
        threads=req["threads"],
    )
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    _child(*sys.argv[1:3])

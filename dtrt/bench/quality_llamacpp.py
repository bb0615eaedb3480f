"""The llama.cpp row of `dtrt quality`: the same GGUF through llama-cpp-python (logits of every position, one thread
unless --threads says otherwise) on exactly the token ids of the other rows' texts and prompts, measured into
measure()'s dict so that quality.compare scores it as it scores them. The row is shown beside the others, not gated.

It runs in a child process (python -m dtrt.bench.quality_llamacpp REQUEST RESULT [--no-repack]), so that a crash
inside llama.cpp costs its row and nothing else; a child that dies of SIGILL (or of SIGSEGV where CPUID reports AMX)
with llama.cpp's weight repacking on is run again with it off (dtrt.bench.repack)."""

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dtrt.bench.peer import describe
from dtrt.bench.quality import _argmax_nll
from dtrt.bench.repack import NO_REPACK, open_llama, retry_command, retry_line

LABEL = "llama.cpp"
OMITTED = (
    'llama.cpp row omitted: llama-cpp-python is not installed (the dtrt[llamacpp] extra: pip install -e ".[llamacpp]")'
)


def _last_logits(llm) -> np.ndarray:
    return np.asarray(llm.scores[llm.n_tokens - 1])


def greedy(llm, ids: list[int], *, max_new_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """The greedy answer to prompt `ids` (its stop token included, as dtrt's) and the seconds from its first token to
    its last, as dtrt's decode_s."""
    llm.reset()
    llm.eval(ids)
    tokens = [int(np.argmax(_last_logits(llm)))]
    t0 = time.perf_counter()
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        llm.eval([tokens[-1]])
        tokens.append(int(np.argmax(_last_logits(llm))))
    return tokens, time.perf_counter() - t0


def llamacpp_measure(llm, seqs: list[list[int]], prompts: list[list[int]], *, max_new_tokens: int, eos, isa: str):
    """quality.measure()'s dict for a loaded Llama (logits_all on, a context that holds the longest text and prompt
    plus answer): the argmax and NLL of every position of each text from its logits, the greedy answer to each
    prompt."""
    scored = []
    for ids in seqs:
        llm.reset()
        llm.eval(ids)
        scored.append(_argmax_nll(torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)), ids))
    answers, tokens, seconds = [], 0, 0.0
    for ids in prompts:
        answer, s = greedy(llm, ids, max_new_tokens=max_new_tokens, eos=set(eos))
        answers.append(answer)
        tokens, seconds = tokens + len(answer) - 1, seconds + s
    return {
        "name": LABEL,
        "argmax": [a.tolist() for a, _ in scored],
        "nll": [n.tolist() for _, n in scored],
        "answers": answers,
        "tok_s": tokens / seconds if seconds > 0 else None,
        "isa": isa,
    }


def child_command(request: Path, result: Path) -> list[str]:
    return [sys.executable, "-m", "dtrt.bench.quality_llamacpp", str(request), str(result)]


def measure_llamacpp(
    gguf: Path, seqs, prompts, *, max_new_tokens: int, threads: int | None, eos, log, command=None
) -> dict | None:
    """The llama.cpp row's measures (llamacpp_measure's dict, its name saying where repacking was off), or None with a
    log line saying why it failed. `command`: the child's command for a request and a result file."""
    n_ctx = max([len(s) for s in seqs] + [len(p) + max_new_tokens for p in prompts] + [16]) + 8
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req = {"gguf": str(gguf), "threads": threads or 1, "n_ctx": n_ctx, "seqs": seqs, "prompts": prompts,
               "max_new_tokens": max_new_tokens, "eos": sorted(eos)}  # fmt: skip
        request.write_text(json.dumps(req))
        argv = (command or child_command)(request, result)
        log(f"measuring {LABEL} ({gguf.name}, {req['threads']} thread(s))")
        while True:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode == 0 and result.is_file():
                got = json.loads(result.read_text())
                if NO_REPACK in argv:
                    got["name"] = f"{LABEL} (repacking off)"
                return got
            again = retry_command(argv, done.returncode)
            if again is None:
                why = describe(LABEL, done.returncode, None, None)
                last = (done.stderr.strip().splitlines() or [""])[-1][:200]
                log(f"{LABEL} row failed: {why}" + (f" ({last})" if last and done.returncode > 0 else ""))
                return None
            log(retry_line(LABEL, done.returncode))
            argv = again


def llamacpp_peer(gguf: Path | None, *, threads: int | None, eos, log):
    """(seqs, prompts, max_new_tokens) -> the llama.cpp row's measures, or None with the line that says why the row
    is omitted."""
    if importlib.util.find_spec("llama_cpp") is None:
        log(OMITTED)
        return None
    if gguf is None:
        log("llama.cpp row omitted: pass --gguf PATH (the GGUF of the same target)")
        return None
    return lambda seqs, prompts, max_new_tokens: measure_llamacpp(
        gguf, seqs, prompts, max_new_tokens=max_new_tokens, threads=threads, eos=eos, log=log
    )


def main(argv: list[str]):
    import llama_cpp

    req = json.loads(Path(argv[0]).read_text())
    threads = req["threads"]
    llm = open_llama(
        llama_cpp.Llama, req["gguf"], repack=NO_REPACK not in argv, n_threads=threads, n_threads_batch=threads,
        n_ctx=req["n_ctx"], logits_all=True, verbose=False,
    )  # fmt: skip
    eos = {*req["eos"], int(llm.token_eos())}
    isa = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
    out = llamacpp_measure(llm, req["seqs"], req["prompts"], max_new_tokens=req["max_new_tokens"], eos=eos, isa=isa)
    Path(argv[1]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])

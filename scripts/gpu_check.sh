#!/usr/bin/env bash
# One-command GPU check (PyTorch with CUDA and Triton; TensorRT not needed): the DominoTree tree-build time per
# round at Qwen3-4B shapes (V=151936, H=2560, G=1024, E=256, budget 32, M=64, k=8, D=16, random weights),
# sequential heap vs frontier side by side, drafting + tree building eager vs one CUDA graph on the tiny pair, then
# every `gpu`- and `kernels`-marked test (last: they compile a kernel per shape and take the longest), every method
# on ONNX Runtime's CUDA provider through IO binding (when onnxruntime-gpu's CUDA provider is installed; nothing is
# installed here), and a short summary.
#
#   bash scripts/gpu_check.sh            # results also go to gpu-check/ (or $GPU_CHECK_OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_CHECK_OUT:-gpu-check}"
mkdir -p "$out"

python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device is visible to torch {torch.__version__}; run this on a CUDA machine")
try:
    import triton
except ImportError:
    sys.exit('gpu_check: Triton is not installed (pip install "dtrt[gpu]")')
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}")
PY


start=$SECONDS
python benchmarks/tree_build.py --device cuda --budgets 32 --rounds 30 --warmup 3 --json "$out/tree_build.json" \
    | tee "$out/tree_build.md"
bench_s=$((SECONDS - start))

start=$SECONDS
set +e
python benchmarks/draft_graph.py --device cuda --prompts 4 --max-new-tokens 64 --json "$out/draft_graph.json" \
    2>&1 | tee "$out/draft_graph.md"
graph_rc=${PIPESTATUS[0]}
set -e
graph_s=$((SECONDS - start))

start=$SECONDS
set +e
# only the files that hold such tests: the others need packages a bare CUDA machine may lack (polygraphy, gguf),
# and one module that fails to import stops the whole collection; the ONNX Runtime CUDA tests run in their own
# step below
files=$(grep -l -E "mark\.(gpu|kernels)|pytestmark = .*(gpu|kernels)" tests/test_*.py | grep -v test_ort_device.py)
# GPU_CHECK_TESTS_S: seconds the tests may take (0, the default: no limit), so that a time-boxed run still reaches
# the benchmarks below
timeout "${GPU_CHECK_TESTS_S:-0}" python -m pytest -q -m "gpu or kernels" $files -p no:cacheprovider \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
set -e
tests_s=$((SECONDS - start))

start=$SECONDS
ort_rc=0
rm -f "$out/ort-cuda.xml" "$out/ort-cuda-skipped.txt"
if ort_why=$(python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers(), \
        f'onnxruntime {o.__version__} has no CUDA provider (available: {o.get_available_providers()}); to run it: \
pip uninstall -y onnxruntime && pip install onnxruntime-gpu'" 2>&1); then
    set +e
    python -m pytest -q -m gpu tests/test_ort_device.py -p no:cacheprovider --junitxml="$out/ort-cuda.xml" 2>&1 \
        | tee "$out/ort-cuda.log"
    ort_rc=${PIPESTATUS[0]}
    set -e
else
    ort_why=$(printf '%s\n' "$ort_why" | tail -n 1)
    echo "gpu_check: ONNX Runtime CUDA step skipped: ${ort_why#AssertionError: }" | tee "$out/ort-cuda-skipped.txt"
fi
ort_s=$((SECONDS - start))

python - "$out" "$tests_rc" "$tests_s" "$bench_s" "$graph_rc" "$graph_s" "$ort_rc" "$ort_s" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET

out, rc, tests_s, bench_s, graph_rc, graph_s, ort_rc, ort_s = sys.argv[1], *map(int, sys.argv[2:])


def counts(path):
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    bad = int(suite.get("failures")) + int(suite.get("errors"))
    return f"{n - bad - skipped} passed, {bad} failed, {skipped} skipped"


row = json.load(open(f"{out}/tree_build.json"))["results"][0]
print("\n== gpu_check summary ==")
if os.path.exists(f"{out}/gpu-tests.xml"):
    print(f"gpu tests: {counts(f'{out}/gpu-tests.xml')} ({tests_s} s)")
else:
    print(f"gpu tests: stopped after {tests_s} s (GPU_CHECK_TESTS_S), see {out}/gpu-tests.log")
print(f"tree build per round, budget {row['budget']} at Qwen3-4B shapes ({bench_s} s): "
      f"heap {row['heap_median_ms']:.3f} ms (p90 {row['heap_p90_ms']:.3f}), "
      f"frontier {row['frontier_median_ms']:.3f} ms (p90 {row['frontier_p90_ms']:.3f}), "
      f"same tree {row['same_tree']}/{row['rounds']}")
print(f"frontier vs the aim of 0.3 ms on an H200: {'met' if row['frontier_median_ms'] <= 0.3 else 'not met'} "
      f"(the paper's fused builder: 0.88 ms on an RTX 5080)")
if graph_rc:
    print(f"drafting + build as a CUDA graph (tiny pair): the benchmark failed, see {out}/draft_graph.md")
else:
    g = json.load(open(f"{out}/draft_graph.json"))
    e, c = g["results"]["eager"], g["results"]["graph"]
    print(f"drafting + build per round, tiny pair, budget 16 ({graph_s} s): eager {e['draft_build_median_ms']:.3f} ms, "
          f"CUDA graph {c['draft_build_median_ms']:.3f} ms; tok/s {e['tok_s_median']:.0f} vs {c['tok_s_median']:.0f}; "
          f"same tokens {g['same_tokens']}/{g['prompts']}")
if os.path.exists(f"{out}/ort-cuda.xml"):
    print(f"ONNX Runtime CUDA provider, every method vs the torch AR tokens: {counts(f'{out}/ort-cuda.xml')} "
          f"({ort_s} s)")
elif os.path.exists(f"{out}/ort-cuda-skipped.txt"):
    print(open(f"{out}/ort-cuda-skipped.txt").read().strip().removeprefix("gpu_check: "))
else:
    print(f"ONNX Runtime CUDA provider: the tests did not run, see {out}/ort-cuda.log")
sys.exit(1 if rc or graph_rc or ort_rc else 0)
PY

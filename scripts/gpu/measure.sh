#!/usr/bin/env bash
# An offline GPU job's measurement call: the verify-cost curve and a DominoTree round's breakdown at Qwen3-4B shapes
# (benchmarks/gpu_shapes.py); then, where the job's last part's call (the training call, or a measure-only job's
# unpack) left the pair in MEASURE_PAIR (its work folder: the rebuilt target/ and the stage's drafter and held-out
# prompts), `dtrt bench` end to end on that real pair on the GPU (AR and DominoTree, eager and captured side by
# side, T=0); then scripts/gpu_check.sh (the gpu/kernels tests on CUDA, the tree-build time heap vs frontier, the
# CUDA-graph round); each under its share of the seconds given.
# Everything it wrote comes back as OUT/measure.tgz, the log as OUT/measure.log.
#
#   [MEASURE_PAIR=DIR] bash scripts/gpu/measure.sh OUT SECONDS [--dry-run]  # --dry-run: the steps on the CPU, tiny
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # dtrt is the checkout there, not an installed package
work=$(mktemp -d)
bin=""
trap 'rm -rf "$work" ${bin:+"$bin"}' EXIT  # everything it keeps is in OUT/measure.tgz
if ! command -v python >/dev/null 2>&1; then  # gpu_check.sh calls `python`; some images have only python3
    bin=$(mktemp -d) && ln -sf "$(command -v python3)" "$bin/python" && export PATH="$bin:$PATH"
fi
out="$1"
seconds="${2:?usage: measure.sh OUT SECONDS [--dry-run]}"
dry="${3:-}"
mkdir -p "$out" "$work/gpu-check"
log="$out/measure.log"
start=$SECONDS
rc=0
shapes_s=$((seconds * 45 / 100))
# dtrt bench on the pair the job rebuilt there, where there is one: DEVICE PROMPTS TOKENS SECONDS
e2e() {
    local pair="${MEASURE_PAIR:-}" prompts
    if [ -z "$pair" ] || [ ! -f "$pair/target/config.json" ] || [ ! -d "$pair/stage/drafter" ]; then
        echo "measure: no pair in MEASURE_PAIR (${pair:-unset}): the end-to-end bench is skipped" | tee -a "$log"
        return 0
    fi
    prompts=$(ls "$pair"/stage/held-out/*.jsonl | paste -sd, -)
    # --budget and --no-lookup: the GPU's defaults for a model without an entry, named so that the dry run on the
    # CPU (whose defaults differ) times the same rows
    timeout "$4" python3 -c 'from dtrt.entry import main; main()' bench --target "$pair/target" \
        --drafter "$pair/stage/drafter" --device "$1" --graphs eager,captured --no-compile --methods ar,dominotree \
        --budget 16 --no-lookup \
        --datasets "$prompts" --prompts "$2" --max-new-tokens "$3" --temperatures 0 --out "$work/bench-e2e" \
        2>&1 | tee -a "$log" || rc=1
}
if [ "$dry" = "--dry-run" ]; then
    e2e cpu 1 12 120
    python3 benchmarks/gpu_shapes.py --device cpu --tiny --budget-s "$shapes_s" --json "$work/gpu_shapes.json" \
        2>&1 | tee -a "$log" || rc=1
    python3 benchmarks/tree_build.py --device cpu --vocab 512 --hidden 64 --gru 32 --emb 16 --topm 8 --depth 4 \
        --budgets 8 --rounds 3 --json "$work/gpu-check/tree_build.json" 2>&1 | tee -a "$log" || rc=1
    python3 - <<'PY' 2>&1 | tee -a "$log"
import torch
print("gpu_check.sh: skipped in the dry run" if not torch.cuda.is_available() else "gpu_check.sh: CUDA is there")
PY
else
    if [ -z "${MEASURE_SKIP_SHAPES:-}" ]; then  # set on a later job's call that has them already
        timeout "$((shapes_s + 20))" python3 benchmarks/gpu_shapes.py --device cuda --budget-s "$shapes_s" \
            --json "$work/gpu_shapes.json" 2>&1 | tee -a "$log" || rc=1
    fi
    e2e cuda 3 128 "$((seconds * 30 / 100))"
    left=$((seconds - (SECONDS - start) - 5))
    GPU_CHECK_OUT="$work/gpu-check" GPU_CHECK_TESTS_S=$((left * 70 / 100)) timeout "$left" bash scripts/gpu_check.sh 2>&1 | tee -a "$log" || rc=1
fi
tar -czf "$out/measure.tgz" -C "$work" .
echo "measure: $((SECONDS - start))s, exit $rc; results in measure.tgz" | tee -a "$log"
exit $rc

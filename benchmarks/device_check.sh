#!/usr/bin/env bash
# GPU evidence in one run (about 6-8 minutes on one H100/H200-class GPU):
#   1. the GPU-marked tests (tests/gpu: bf16 weights with fp32 log-probs give ratio 1; tiny TreeGRPO steps on CUDA);
#   2. a reduced SD3.5-medium-architecture speed check (random weights, 512 px, bf16; the shipped recipes of
#      TreeGRPO's paper preset, TreeGRPO's official-code preset and DanceGRPO), each preset in its own process so that
#      its peak GPU memory is its own (benchmarks/gpu_speed.py says exactly what is substituted);
#   3. OUT/device_check.{json,md}: s/iter, phase times, peak memory, DanceGRPO/TreeGRPO ratios next to the paper's.
#
# Usage (rlpost installed in the Python that runs it, e.g. `pip install -e ".[dev]"` with your CUDA torch):
#   HF_HUB_OFFLINE=1 bash benchmarks/device_check.sh [OUT_DIR] [PRESETS...]
# Environment: PYTHON (default python3), MODEL_DIR (random SD3.5-M build, default ~/.cache/rlpost/sd35m-random),
# PROMPTS_PER_ITER (prompt groups per iteration, default 1), ITERATIONS (steps per preset incl. one warm-up, default 3),
# PRESET_TIMEOUT_S (per preset, default 150), TESTS_TIMEOUT_S (180), BUILD_TIMEOUT_S (240).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/device-check}
shift || true
PRESETS=("$@")
[ ${#PRESETS[@]} -eq 0 ] && PRESETS=(treegrpo-paper treegrpo-code dancegrpo)
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/rlpost/sd35m-random}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
status=0

echo "== GPU-marked tests"
if ! timeout "${TESTS_TIMEOUT_S:-180}" "$PY" -m pytest -m gpu tests/gpu -q 2>&1 | tee "$OUT/gpu_tests.log"; then
  echo "GPU-marked tests FAILED (see $OUT/gpu_tests.log)"; status=1
fi

echo "== build the random SD3.5-medium pipeline ($MODEL_DIR)"
if ! timeout "${BUILD_TIMEOUT_S:-240}" "$PY" benchmarks/gpu_speed.py build --model-dir "$MODEL_DIR" 2>&1 | tee -a "$OUT/logs.txt"; then
  echo "model build FAILED"; exit 1
fi

for preset in "${PRESETS[@]}"; do
  echo "== $preset"
  if ! timeout "${PRESET_TIMEOUT_S:-150}" "$PY" benchmarks/gpu_speed.py run --preset "$preset" --model-dir "$MODEL_DIR" \
      --out "$OUT/$preset.json" --groups "${PROMPTS_PER_ITER:-1}" --iterations "${ITERATIONS:-3}" >"$OUT/$preset.log.tmp" 2>&1; then
    echo "$preset FAILED or timed out; last lines:"; tail -n 25 "$OUT/$preset.log.tmp"; status=1
  else
    tail -n 1 "$OUT/$preset.log.tmp"
  fi
  { echo "== $preset"; cat "$OUT/$preset.log.tmp"; } >>"$OUT/logs.txt"; rm -f "$OUT/$preset.log.tmp"
done

echo "== report"
"$PY" benchmarks/gpu_speed.py report "$OUT" || status=1
exit $status

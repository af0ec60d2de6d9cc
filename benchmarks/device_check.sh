#!/usr/bin/env bash
# GPU evidence in one run (about 6-8 minutes on one H100/H200-class GPU for SD3.5, 3-5 more for FLUX.1):
#   1. the GPU-marked tests (tests/gpu: bf16 weights with fp32 log-probs give ratio 1; tiny TreeGRPO steps on CUDA);
#   2. a reduced SD3.5-medium-architecture speed check (random weights, 512 px, bf16; the shipped recipes of
#      TreeGRPO's paper preset, TreeGRPO's official-code preset and DanceGRPO), each preset in its own process so that
#      its peak GPU memory is its own (benchmarks/gpu_speed.py says exactly what is substituted);
#   3. a FLUX.1-dev-architecture speed check (random 12B weights, 512 px, bf16, LoRA in place of the recipes'
#      multi-GPU full fine-tuning; preset dancegrpo-flux = recipes/dancegrpo_flux.yaml), so one run covers both
#      model families (needs ~25 GB of disk for the random FLUX.1 build);
#   4. OUT/device_check.{json,md}: s/iter, phase times, peak memory, DanceGRPO/TreeGRPO ratios next to the paper's.
#
# Usage (rlpost installed in the Python that runs it, e.g. `pip install -e ".[dev]"` with your CUDA torch):
#   HF_HUB_OFFLINE=1 bash benchmarks/device_check.sh [OUT_DIR] [PRESETS...]
# PRESETS: names from benchmarks/gpu_speed.py (default: treegrpo-paper treegrpo-code dancegrpo dancegrpo-flux); a
# family's model is built only when one of its presets is listed (*-flux presets use the FLUX.1 build).
# Environment: PYTHON (default python3), MODEL_DIR (random SD3.5-M build, default ~/.cache/rlpost/sd35m-random),
# FLUX_MODEL_DIR (random FLUX.1-dev build, default ~/.cache/rlpost/flux1dev-random),
# PROMPTS_PER_ITER (prompt groups per iteration, default 1), ITERATIONS (steps per preset incl. one warm-up, default 3),
# PRESET_TIMEOUT_S (per SD3.5 preset, default 150), FLUX_PRESET_TIMEOUT_S (per FLUX preset, default 300),
# TESTS_TIMEOUT_S (180), BUILD_TIMEOUT_S (240), FLUX_BUILD_TIMEOUT_S (300).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/device-check}
shift || true
PRESETS=("$@")
[ ${#PRESETS[@]} -eq 0 ] && PRESETS=(treegrpo-paper treegrpo-code dancegrpo dancegrpo-flux)
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/rlpost/sd35m-random}
FLUX_MODEL_DIR=${FLUX_MODEL_DIR:-$HOME/.cache/rlpost/flux1dev-random}
want_sd3=0; want_flux=0
for preset in "${PRESETS[@]}"; do
  case "$preset" in *-flux) want_flux=1 ;; *) want_sd3=1 ;; esac
done
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
status=0

echo "== GPU-marked tests"
if ! timeout "${TESTS_TIMEOUT_S:-180}" "$PY" -m pytest -m gpu tests/gpu -q 2>&1 | tee "$OUT/gpu_tests.log"; then
  echo "GPU-marked tests FAILED (see $OUT/gpu_tests.log)"; status=1
fi

if [ $want_sd3 -eq 1 ]; then
  echo "== build the random SD3.5-medium pipeline ($MODEL_DIR)"
  if ! timeout "${BUILD_TIMEOUT_S:-240}" "$PY" benchmarks/gpu_speed.py build --model-dir "$MODEL_DIR" 2>&1 | tee -a "$OUT/logs.txt"; then
    echo "SD3.5 model build FAILED"; exit 1
  fi
fi
if [ $want_flux -eq 1 ]; then
  echo "== build the random FLUX.1-dev pipeline ($FLUX_MODEL_DIR)"
  if ! timeout "${FLUX_BUILD_TIMEOUT_S:-300}" "$PY" benchmarks/gpu_speed.py build --family flux --model-dir "$FLUX_MODEL_DIR" 2>&1 | tee -a "$OUT/logs.txt"; then
    echo "FLUX.1 model build FAILED"; exit 1
  fi
fi

for preset in "${PRESETS[@]}"; do
  echo "== $preset"
  case "$preset" in
    *-flux) dir=$FLUX_MODEL_DIR; limit=${FLUX_PRESET_TIMEOUT_S:-300} ;;
    *) dir=$MODEL_DIR; limit=${PRESET_TIMEOUT_S:-150} ;;
  esac
  if ! timeout "$limit" "$PY" benchmarks/gpu_speed.py run --preset "$preset" --model-dir "$dir" \
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

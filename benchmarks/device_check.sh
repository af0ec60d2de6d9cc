#!/usr/bin/env bash
# GPU evidence in one prepared run of at most ~8 minutes on one H100/H200-class GPU (TOTAL_BUDGET_S):
#   1. the GPU-marked tests (tests/gpu: bf16 weights with fp32 log-probs give ratio 1; tiny TreeGRPO steps on CUDA;
#      the run.speedups speed-ups that need CUDA: CUDA graphs, GPU attention kernels, bf16 autocast, the guard);
#   2. SD3.5-medium architecture (random weights, 512 px, bf16): TreeGRPO's paper and official-code presets and
#      DanceGRPO from their shipped recipes, each without and then with the speed-ups (`+fast`: torch.compile of the
#      transformer blocks for rollout and update, channels-last VAE; the ratio guard runs before training), each arm in
#      its own process so that its peak GPU memory is its own (benchmarks/gpu_speed.py says what is substituted);
#   3. Wan2.1-T2V-1.3B architecture (random weights, WAN_VIDEO frames x height x width, default 33x480x832): TreeGRPO
#      (paper preset) and DanceGRPO;
#   4. OUT/device_check.{json,md}: s/iter, rollout vs update seconds, set-up (incl. compilation and the guard), the
#      guard's max |ratio - 1|, peak memory (rollout / update), DanceGRPO/TreeGRPO ratios and what the speed-ups
#      bought; copied to DOCS_OUT (default docs/benchmarks/gpu) as <gpu>_speedups.{md,json} with the tests' log.
# Arms start in order while the budget lasts; each arm's limit is its own timeout or the budget left, whichever is
# smaller, and an arm that did not start is listed as "not started (budget)".
#
# Usage (rlpost installed in the Python that runs it, e.g. `pip install -e ".[dev]"` with your CUDA torch):
#   HF_HUB_OFFLINE=1 bash benchmarks/device_check.sh [OUT_DIR] [ARMS...]
# ARMS: PRESET[+fast][@GROUPS] with PRESET from benchmarks/gpu_speed.py (default: dancegrpo treegrpo-paper
# treegrpo-code dancegrpo+fast treegrpo-paper+fast treegrpo-code+fast treegrpo-wan dancegrpo-wan). A family's model
# is built only when one of its arms is listed (*-flux: FLUX.1-dev, ~25 GB of disk; *-wan: Wan2.1-1.3B).
# The rest of the field at its SD3.5 preset (prepared, not in the default run; gpu_speed.py FIELD_ARMS), in two calls
# that fit a 10-minute command (the second skips the GPU-marked tests):
#   HF_HUB_OFFLINE=1 TOTAL_BUDGET_S=560 bash benchmarks/device_check.sh runs/field-a flowgrpo flowgrpo-fast \
#     grpo-guard branchgrpo tempflow
#   HF_HUB_OFFLINE=1 GPU_TESTS=0 TOTAL_BUDGET_S=560 bash benchmarks/device_check.sh runs/field-b nft awm dgpo treenft
# Memory at the paper's 32 prompts per iteration (prepared; ~6 minutes per arm, so not in the default run):
#   HF_HUB_OFFLINE=1 TOTAL_BUDGET_S=900 ITERATIONS=2 bash benchmarks/device_check.sh runs/mem32 treegrpo-paper@32 dancegrpo@32
# Environment: PYTHON (default python3), MODEL_DIR (random SD3.5-M build, default ~/.cache/rlpost/sd35m-random),
# FLUX_MODEL_DIR (~/.cache/rlpost/flux1dev-random), WAN_MODEL_DIR (~/.cache/rlpost/wan21-1.3b-random),
# PROMPTS_PER_ITER (prompt groups per iteration unless an arm says @GROUPS, default 1), ITERATIONS (steps per SD3.5 or
# FLUX arm incl. one warm-up, default 3), WAN_ITERATIONS (2), WAN_VIDEO (33x480x832), ACCELERATE (run.speedups of
# +fast arms as KEY=VALUE words, default gpu_speed.py's FAST), TOTAL_BUDGET_S (480), TESTS_TIMEOUT_S (150),
# PRESET_TIMEOUT_S (plain SD3.5 arm, 100), FAST_TIMEOUT_S (+fast SD3.5 arm, 180), WAN_TIMEOUT_S (240),
# FLUX_PRESET_TIMEOUT_S (300), BUILD_TIMEOUT_S (240), FLUX_BUILD_TIMEOUT_S (300), WAN_BUILD_TIMEOUT_S (120),
# GPU_TESTS (1; 0 skips the GPU-marked tests), DOCS_OUT (docs/benchmarks/gpu; empty: do not copy).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/device-check}
shift || true
ARMS=("$@")
[ ${#ARMS[@]} -eq 0 ] && ARMS=(dancegrpo treegrpo-paper treegrpo-code dancegrpo+fast treegrpo-paper+fast
  treegrpo-code+fast treegrpo-wan dancegrpo-wan)
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/rlpost/sd35m-random}
FLUX_MODEL_DIR=${FLUX_MODEL_DIR:-$HOME/.cache/rlpost/flux1dev-random}
WAN_MODEL_DIR=${WAN_MODEL_DIR:-$HOME/.cache/rlpost/wan21-1.3b-random}
BUDGET=${TOTAL_BUDGET_S:-480}
DOCS_OUT=${DOCS_OUT-docs/benchmarks/gpu}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
status=0
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }

note() {  # a record for the report of an arm that produced none (not started, failed, timed out)
  printf '{"preset": "%s", "label": "%s", "skipped": "%s"}\n' "$1" "$1" "$2" >"$OUT/$1.json"
}
family_of() { case "${1%%[+@]*}" in *-flux) echo flux ;; *-wan) echo wan ;; *) echo sd3 ;; esac; }
declare -A built=()
build() {  # build the family's random model once (skipped when the arms need no new model)
  local family=$1 dir cap
  case "$family" in
    flux) dir=$FLUX_MODEL_DIR; cap=${FLUX_BUILD_TIMEOUT_S:-300} ;;
    wan) dir=$WAN_MODEL_DIR; cap=${WAN_BUILD_TIMEOUT_S:-120} ;;
    *) dir=$MODEL_DIR; cap=${BUILD_TIMEOUT_S:-240} ;;
  esac
  [ -n "${built[$family]:-}" ] && return "${built[$family]}"
  echo "== build the random $family pipeline ($dir)"
  if timeout "$(limit "$cap")" "$PY" benchmarks/gpu_speed.py build --family "$family" --model-dir "$dir" 2>&1 \
      | tee -a "$OUT/logs.txt"; then built[$family]=0; else echo "$family model build FAILED"; built[$family]=1; fi
  return "${built[$family]}"
}

if [ "${GPU_TESTS:-1}" = 0 ]; then
  echo "== GPU-marked tests skipped (GPU_TESTS=0)"
else
  echo "== GPU-marked tests"
  if ! timeout "$(limit "${TESTS_TIMEOUT_S:-150}")" "$PY" -m pytest -m gpu tests/gpu -q 2>&1 \
      | tee "$OUT/gpu_tests.log"; then
    echo "GPU-marked tests FAILED or timed out (see $OUT/gpu_tests.log)"; status=1
  fi
fi

read -r -a accel <<<"${ACCELERATE:-}"
accel_args=()
for pair in "${accel[@]}"; do accel_args+=(--accelerate "$pair"); done

for arm in "${ARMS[@]}"; do
  family=$(family_of "$arm")
  if [ "$(left)" -le 10 ]; then
    echo "== $arm: not started (budget of ${BUDGET} s spent)" | tee -a "$OUT/logs.txt"
    note "$arm" "not started: the ${BUDGET} s budget was spent"; status=1; continue
  fi
  build "$family" || { note "$arm" "the $family model build failed"; status=1; continue; }
  case "$family" in
    flux) dir=$FLUX_MODEL_DIR; cap=${FLUX_PRESET_TIMEOUT_S:-300}; iters=${ITERATIONS:-3} ;;
    wan) dir=$WAN_MODEL_DIR; cap=${WAN_TIMEOUT_S:-240}; iters=${WAN_ITERATIONS:-2} ;;
    *) dir=$MODEL_DIR; iters=${ITERATIONS:-3}
       case "$arm" in *+fast*) cap=${FAST_TIMEOUT_S:-180} ;; *) cap=${PRESET_TIMEOUT_S:-100} ;; esac ;;
  esac
  lim=$(limit "$cap")
  echo "== $arm (limit ${lim} s, ${iters} iterations)"
  if ! timeout "$lim" "$PY" benchmarks/gpu_speed.py run --preset "$arm" --model-dir "$dir" --out "$OUT/$arm.json" \
      --groups "${PROMPTS_PER_ITER:-1}" --iterations "$iters" --video "${WAN_VIDEO:-33x480x832}" \
      "${accel_args[@]}" >"$OUT/$arm.log.tmp" 2>&1; then
    echo "$arm FAILED or timed out after ${lim} s; last lines:"; tail -n 25 "$OUT/$arm.log.tmp"; status=1
    [ -f "$OUT/$arm.json" ] || note "$arm" "failed or timed out after ${lim} s (logs.txt)"
  else
    tail -n 1 "$OUT/$arm.log.tmp"
  fi
  { echo "== $arm"; cat "$OUT/$arm.log.tmp"; } >>"$OUT/logs.txt"; rm -f "$OUT/$arm.log.tmp"
done

echo "== report ($((SECONDS - start)) s so far)"
"$PY" benchmarks/gpu_speed.py report "$OUT" || status=1
if [ -n "$DOCS_OUT" ] && [ -f "$OUT/device_check.md" ]; then
  gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else 'cpu')")
  mkdir -p "$DOCS_OUT"
  cp "$OUT/device_check.md" "$DOCS_OUT/${gpu}_speedups.md"
  cp "$OUT/device_check.json" "$DOCS_OUT/${gpu}_speedups.json"
  cp "$OUT/gpu_tests.log" "$DOCS_OUT/${gpu}_speedups_gpu_tests.log" 2>/dev/null || true
  echo "copied to $DOCS_OUT/${gpu}_speedups.{md,json} (commit them)"
fi
exit $status

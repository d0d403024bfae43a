#!/usr/bin/env bash
# The GPU check of issue 13, ready for the day a GPU is lent (under 8 minutes on one CUDA GPU):
#   1. calibrate this machine at the recipe's shapes (tools/plan.py --calibrate),
#   2. plan the recipe for one device (the best micro batch and checkpointing that fit),
#   3. train it for STEPS steps in bf16 (parallel.mixed_precision auto) without and with
#      parallel.compile, and for each run print MFU, measured vs estimated peak memory and
#      planned vs measured step time (tools/plan.py --check-run). No checkpoint is saved: the
#      1B model's final save (15 GB with AdamW's state) would take longer than its 20 steps.
#
#   tools/gpu_check.sh [--device cuda|cpu] [--out DIR]
#
# Settings through the environment (defaults in brackets): RECIPE [llama3.2-1b], STEPS [20],
# GLOBAL_BATCH [16], SEQ_LEN [the recipe's], COMPILE ["false true"], MAX_CHARS [4000000: the
# tokenizer and data come from the first 4M characters of the built-in corpus], PYTHON [python].
# The tests run it with --device cpu, RECIPE=llama-debug and a few steps.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
OUT="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "error: unknown argument $1 (use --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "error: --device $DEVICE is not cuda or cpu" >&2; exit 2 ;; esac

PY="${PYTHON:-python}"
RECIPE="${RECIPE:-llama3.2-1b}"
STEPS="${STEPS:-20}"
GLOBAL_BATCH="${GLOBAL_BATCH:-16}"
COMPILE="${COMPILE:-false true}"
MAX_CHARS="${MAX_CHARS:-4000000}"
SIZES=(--global-batch "$GLOBAL_BATCH")
if [ -n "${SEQ_LEN:-}" ]; then SIZES+=(--seq-len "$SEQ_LEN"); fi
mkdir -p "$OUT"
START=$(date +%s)

echo "== 1/3 calibrate ($DEVICE, $RECIPE shapes)"
"$PY" tools/plan.py --calibrate --device "$DEVICE" --recipe "$RECIPE" "${SIZES[@]}" \
  --out "$OUT/hardware.json" --json "$OUT/calibration-raw.json"

echo "== 2/3 plan $RECIPE for one device"
"$PY" tools/plan.py --recipe "$RECIPE" --nodes 1 --gpus-per-node 1 --hardware "$OUT/hardware.json" \
  "${SIZES[@]}" --top 6 --json "$OUT/plan.json" | tee "$OUT/plan.txt"
FLAGS=$(sed -n 's/^flags: //p' "$OUT/plan.txt")
if [ -z "$FLAGS" ]; then
  echo "error: no plan for $RECIPE fits one device (see $OUT/plan.txt)" >&2
  exit 1
fi

echo "== 3/3 train $STEPS steps, compile: $COMPILE"
for compile in $COMPILE; do
  # shellcheck disable=SC2086  # FLAGS is a list of arguments
  "$PY" recipes/llama.py $FLAGS --train.steps "$STEPS" --train.device "$DEVICE" \
    --parallel.compile "$compile" --data.max_chars "$MAX_CHARS" --metrics.progress_bar false \
    --checkpoint.save_final false \
    --metrics.run_dir "$OUT/run-compile-$compile"
  "$PY" tools/plan.py --check-run "$OUT/run-compile-$compile" --hardware "$OUT/hardware.json" \
    --gpus-per-node 1 --json "$OUT/check-compile-$compile.json"
done

echo "== done in $(( $(date +%s) - START )) s; results in $OUT"
for compile in $COMPILE; do
  "$PY" - "$OUT/check-compile-$compile.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(
    f"compile {str(r['compile']).lower():5}  MFU {r['measured_mfu']:.1%} (planned "
    f"{r['planned_mfu']:.1%})  step {r['measured_step_s']:.3f} s (planned "
    f"{r['planned_step_s']:.3f} s, {r['step_error']:+.0%})  peak {r['measured_peak_gib']:.2f} GiB "
    f"(estimated {r['estimated_peak_gib']:.2f} GiB)"
)
EOF
done

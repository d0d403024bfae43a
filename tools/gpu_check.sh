#!/usr/bin/env bash
# The GPU check of issues 13 and 34, ready for the day a GPU is lent (under 10 minutes on one
# CUDA GPU):
#   1. calibrate this machine at the recipe's shapes (tools/plan.py --calibrate),
#   2. plan the recipe for one device (the best micro batch and checkpointing that fit),
#   3. train it for STEPS steps in bf16 (parallel.mixed_precision auto) without and with
#      parallel.compile, and for each run print MFU, measured vs estimated peak memory and
#      planned vs measured step time (tools/plan.py --check-run). No checkpoint is saved: the
#      1B model's final save (15 GB with AdamW's state) would take longer than its 20 steps.
#      The first run also traces two steps (--profile.trace_steps) and writes the run report
#      (tools/run_report.py); each run's balance.jsonl is checked: its parts add up to the step
#      and, on CUDA, the device's utilisation and memory were read (issue 37's CUDA path).
#   4. run tests/test_cuda.py (at most CUDA_TESTS_TIMEOUT seconds): the compiled FlexAttention
#      BlockMask path against SDPA with the dense mask (document masks, sliding windows, both),
#      Gemma 3-like and Qwen3-like models against transformers, packed rows against each
#      document alone, a LoRA step against PEFT, all on the GPU (they need pytest, transformers
#      and peft; a test whose package is missing is listed as skipped). --device cpu skips it.
#      The script's exit status is that of the tests when they fail.
#
#   tools/gpu_check.sh [--device cuda|cpu] [--out DIR]
#
# Settings through the environment (defaults in brackets): RECIPE [llama3.2-1b], STEPS [20],
# GLOBAL_BATCH [16], SEQ_LEN [the recipe's], COMPILE ["false true"], MAX_CHARS [4000000: the
# tokenizer and data come from the first 4M characters of the built-in corpus], PYTHON [python],
# CUDA_TESTS_TIMEOUT [300].
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

echo "== 1/4 calibrate ($DEVICE, $RECIPE shapes)"
"$PY" tools/plan.py --calibrate --device "$DEVICE" --recipe "$RECIPE" "${SIZES[@]}" \
  --out "$OUT/hardware.json" --json "$OUT/calibration-raw.json"

echo "== 2/4 plan $RECIPE for one device"
"$PY" tools/plan.py --recipe "$RECIPE" --nodes 1 --gpus-per-node 1 --hardware "$OUT/hardware.json" \
  "${SIZES[@]}" --top 6 --json "$OUT/plan.json" | tee "$OUT/plan.txt"
FLAGS=$(sed -n 's/^flags: //p' "$OUT/plan.txt")
if [ -z "$FLAGS" ]; then
  echo "error: no plan for $RECIPE fits one device (see $OUT/plan.txt)" >&2
  exit 1
fi

echo "== 3/4 train $STEPS steps, compile: $COMPILE"
TRACE_FROM=$(( STEPS > 2 ? STEPS / 2 : 1 ))
TRACE=(--profile.trace_steps "$TRACE_FROM-$(( TRACE_FROM < STEPS ? TRACE_FROM + 1 : TRACE_FROM ))")
for compile in $COMPILE; do
  RUN="$OUT/run-compile-$compile"
  # shellcheck disable=SC2086  # FLAGS is a list of arguments
  "$PY" recipes/llama.py $FLAGS --train.steps "$STEPS" --train.device "$DEVICE" \
    --parallel.compile "$compile" --data.max_chars "$MAX_CHARS" --metrics.progress_bar false \
    --checkpoint.save_final false "${TRACE[@]}" \
    --metrics.run_dir "$RUN"
  TRACE=()
  "$PY" tools/plan.py --check-run "$RUN" --hardware "$OUT/hardware.json" \
    --gpus-per-node 1 --json "$OUT/check-compile-$compile.json"
  "$PY" - "$RUN/balance.jsonl" "$DEVICE" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
parts = ("compute_s", "comm_s", "data_s", "optimizer_s", "checkpoint_s", "other_s")
for record in records:
    for r in record["ranks"]:
        total = sum(r[p] for p in parts)
        if abs(total - r["step_s"]) > 1e-6 * max(r["step_s"], 1e-9) + 1e-9:
            sys.exit(f"error: {sys.argv[1]} step {record['step']}: parts {total} != {r['step_s']}")
        if sys.argv[2] == "cuda" and r["device_mem_bytes"] is None:
            sys.exit(f"error: {sys.argv[1]} step {record['step']}: no device memory on cuda")
r = records[-1]["ranks"][0]
util = "-" if r["device_util"] is None else f"{r['device_util']:.0f}%"
mem = "-" if r["device_mem_bytes"] is None else f"{r['device_mem_bytes'] / 2**30:.2f} GiB"
print(
    f"balance.jsonl: {len(records)} records, parts add up; last step {r['step_s']:.3f} s: "
    f"compute {r['compute_s']:.3f}, comm {r['comm_s']:.3f}, data {r['data_s']:.3f}, "
    f"optimizer {r['optimizer_s']:.3f}; device util {util}, reserved {mem}"
)
EOF
done
"$PY" tools/run_report.py --run-dir "$OUT/run-compile-${COMPILE%% *}"

echo "== 4/4 CUDA kernels, families and LoRA against their references (tests/test_cuda.py)"
CUDA_TESTS=0
if [ "$DEVICE" = cuda ]; then
  timeout "${CUDA_TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
    2>&1 | tee "$OUT/cuda-tests.txt" || CUDA_TESTS=$?
else
  echo "skipped: --device cpu (tests/test_cuda.py needs a CUDA device)"
fi

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
if [ "$CUDA_TESTS" -ne 0 ]; then
  echo "error: tests/test_cuda.py failed (exit $CUDA_TESTS; 124: past CUDA_TESTS_TIMEOUT); see $OUT/cuda-tests.txt" >&2
  exit "$CUDA_TESTS"
fi

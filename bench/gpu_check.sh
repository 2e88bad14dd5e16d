#!/usr/bin/env bash
# GPU check of autosp's kernels and of the whole step: one command, installs nothing (no network needed), budgeted
# to finish in 10 minutes on an H200 with a cold Triton cache (a 600 s budget; not yet run on one).
#
#   bash bench/gpu_check.sh OUT_DIR        # from the repo root; the repo need not be pip-installed
#
#  1. environment (GPU, torch, triton)
#  2. correctness at real sizes against float64 (bf16 / fp16 / fp32; a kernel's worst element within
#     2x SDPA's own), in parallel with the CUDA tests in tests/gpu/
#  3. quick autotuning (bench/autotune.py: attention, then the Ulysses copy; every candidate checked
#     against float64 before it is timed) into OUT_DIR/kernel_configs.json, which later steps read
#  4. Ulysses pack/unpack bandwidth against a plain copy
#  5. TFLOP/s forward and backward against SDPA's FLASH and cuDNN backends -- printed last
#  6. masked_attention's kernel: packed documents against plain causal at the same length
#  7. the whole step on this GPU (bench/gpu_step.py): Llama 3.2 1B's shapes (4 layers), bf16, s = 32K, sp 1: the plan
#     at budgets 1.0 / 0.5 / least, 0.5 untiled, 0.5 compiled by inductor, the least with activations offloaded
#     through the pinned pool on a side stream; torch.cuda.max_memory_allocated against plan.peak_bytes, step time
#     against eager at 0.5
#  8. the whole step, planned and run (bench/plan_vs_train.py): a 1B-shaped Llama in bf16 on this one GPU (sp 1),
#     `autosp plan --memory 24GiB` gives the longest length, `autosp train` runs it 3 steps: the CUDA memory
#     model's prediction against torch.cuda.max_memory_allocated, and the step time
#
# OUT_DIR holds 8 files: logs.tar.gz (every step's log), summary.txt, kernel_configs.json, a2a_table.md,
# attention_table.md, masked_table.md, whole_step_table.md, step_table.md (the tarball's listing is in summary.txt).
# Each step has its own time limit inside a total budget (GPU_CHECK_BUDGET seconds, default 600); a step that runs out
# of time, or finds no time left, is named as cut. Exit status: 0 only if every step passed.
set -uo pipefail

OUT="${1:-bench/out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export AUTOSP_KERNEL_CONFIGS="$OUT/kernel_configs.json"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # silence 3.9's warning; 3.6 ignores it
unset TRITON_INTERPRET  # compiled kernels (the scripts set it themselves where there is no GPU)
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-600}"
START=$SECONDS
STATUS=()
FAILED=()
CUT=()

limit_for() {  # limit_for WANTED: the step's limit within what is left of the budget (0: no time)
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then echo 0; elif [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}

record() {  # record NAME RC SECONDS
  local note=""
  if [ "$2" = 124 ] || [ "$2" = 137 ]; then note=" CUT (time limit)"; CUT+=("$1"); fi
  [ "$2" != 0 ] && FAILED+=("$1")
  STATUS+=("$1: rc=$2$note ($3s)")
}

run_step() {  # run_step NAME WANTED_LIMIT_S CMD...: log to $LOGS/NAME.log, record the exit status
  local name=$1 limit
  limit=$(limit_for "$2")
  shift 2
  if [ "$limit" = 0 ]; then
    CUT+=("$name"); FAILED+=("$name"); STATUS+=("$name: CUT (no time left in the ${BUDGET}s budget)")
    echo "== $name: CUT, no time left"; return 0
  fi
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$((SECONDS - t0))"
  echo "   rc=$rc in $((SECONDS - t0))s; last lines:"
  tail -n 4 "$LOGS/$name.log" | sed 's/^/   | /'
  return 0
}

run_step env 20 bash -c "nvidia-smi; $PY - <<'EOF'
import numpy, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU', 'numpy', numpy.__version__)
import triton
print('triton', triton.__version__)
import autosp.kernels
print('autosp.kernels imported')
EOF"

# 2. correctness: the real-size check and the CUDA unit tests compile different kernels: side by side.
LIM=$(limit_for 120)
echo "== check + pytest (parallel, limit ${LIM}s)"
t0=$SECONDS
timeout --kill-after=10 "$LIM" "$PY" bench/bench_kernels.py check >"$LOGS/check.log" 2>&1 &
PID_CHECK=$!
timeout --kill-after=10 "$LIM" "$PY" -m pytest tests/gpu -q -p no:cacheprovider >"$LOGS/pytest_cuda.log" 2>&1 &
PID_TEST=$!
wait $PID_CHECK; RC_CHECK=$?
wait $PID_TEST; RC_TEST=$?
record check "$RC_CHECK" "$((SECONDS - t0))"
record pytest_cuda "$RC_TEST" "$((SECONDS - t0))"
grep -E "ok|FAIL|PASSED|FAILED|triton ==" "$LOGS/check.log" | sed 's/^/   | /'
tail -n 3 "$LOGS/pytest_cuda.log" | sed 's/^/   | /'

# 3. quick autotuning at two lengths; other lengths use the nearest tuned bucket.
run_step autotune_attention 60 "$PY" bench/autotune.py --kernels fwd,bwd --seqs 4096,16384 --rep-ms 25
run_step autotune_a2a 20 "$PY" bench/autotune.py --kernels copy --s-locs 8192 --rep-ms 20

# 4, 5. benchmarks (tuned configs from step 3)
run_step a2a 25 "$PY" bench/bench_kernels.py a2a --out "$OUT/a2a_table.md"
run_step table 70 "$PY" bench/bench_kernels.py table --out "$OUT/attention_table.md"
run_step masked 30 "$PY" bench/bench_kernels.py masked --out "$OUT/masked_table.md"

# 7. the whole step on this GPU at 32K (bench/gpu_step.py): remat 1.0 / 0.5 / least, untiled, compiled, offloaded;
#    each against its plan's peak and against eager at 0.5
run_step whole_step 170 bash -c "$PY bench/gpu_step.py --seq 32768 --layers 4 --out $LOGS/whole_step \
  | sed -n '/^| configuration/,\$p' > $OUT/whole_step_table.md; cat $OUT/whole_step_table.md"

# 8. the whole step at the planned length: predicted against measured memory (no refusal check: CPU-only planning)
run_step step 100 bash -c "$PY bench/plan_vs_train.py --models llama-3.2-1b --memory llama-3.2-1b=24GiB \
  --precisions bf16 --offload no --sp 1 --device cuda --no-refuse --out $LOGS/step | tail -n 4 > $OUT/step_table.md; \
  cat $OUT/step_table.md"

tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
{
  echo "== summary ($((SECONDS - START))s total, budget ${BUDGET}s; logs in $OUT/logs.tar.gz)"
  printf '   %s\n' "${STATUS[@]}"
  [ "${#CUT[@]}" -gt 0 ] && echo "   cut: ${CUT[*]}"
  [ "${#FAILED[@]}" -gt 0 ] && echo "   FAILED: ${FAILED[*]}"
  echo
  [ -f "$OUT/a2a_table.md" ] && cat "$OUT/a2a_table.md"
  echo
  [ -f "$OUT/masked_table.md" ] && cat "$OUT/masked_table.md" && echo
  [ -f "$OUT/step_table.md" ] && cat "$OUT/step_table.md" && echo
  [ -f "$OUT/whole_step_table.md" ] && cat "$OUT/whole_step_table.md" && echo
  if [ -f "$OUT/attention_table.md" ]; then
    cat "$OUT/attention_table.md"
  else
    echo "attention table missing: the end of table.log:"
    tail -n 20 "$LOGS/table.log" 2>/dev/null
  fi
} | tee "$OUT/summary.txt"
[ "${#FAILED[@]}" = 0 ]

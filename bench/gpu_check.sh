#!/usr/bin/env bash
# GPU check of autosp's kernels and of the whole step: one command, installs nothing (no network needed), budgeted
# to finish inside the device tool's 10-minute command on an H200 with a cold Triton cache (a 570 s budget).
#
#   bash bench/gpu_check.sh OUT_DIR        # from the repo root; the repo need not be pip-installed
#
#  1. environment (GPU, torch, triton)
#  2. correctness at real sizes against float64 (bf16 / fp16 / fp32; a kernel's worst element within
#     2x SDPA's own), in parallel with the CUDA tests in tests/gpu/
#  3. the whole step on this GPU (bench/gpu_step.py): Llama 3.2 1B's shapes (4 layers), bf16, s = 32K, sp 1: the
#     plan at budgets 1.0 / 0.5 / least, the least untiled, 0.5 with activations offloaded through the pinned pool
#     on a side stream instead of recomputed (planned as if the host link were free, so that it offloads: 7.14 GiB),
#     eager and compiled, and 0.5 compiled by inductor; torch.cuda.max_memory_allocated against plan.peak_bytes,
#     step time against eager at 0.5, the offloaded step against eager 1.0 (the copies' cost once overlapped)
#  4. where the planner itself offloads at the real link's 50 GB/s: 131,072 tokens, 2 layers, the least (3.99 GiB
#     offloaded, 27 s of planning on the 2-core CPU machine), against the same least recomputing
#  5. with GPU_CHECK_TUNE=1, quick autotuning of attention (bench/autotune.py; every candidate checked against
#     float64 before it is timed) into OUT_DIR/kernel_configs.json, which later steps read; then TFLOP/s forward and
#     backward against SDPA's FLASH and cuDNN backends (printed last; the speedups over the best backend go to
#     kernel_configs.json, which decides where the step calls autosp's kernel)
#  6. the main job: `autosp train` of Llama 3.2 1B (16 layers) at 32K, bf16, AdamW, remat budget 0.3, 2 steps: the
#     CUDA memory model's predicted peak against torch.cuda.max_memory_allocated, and the step time (last but for 7:
#     the first run measured it, +0.14 %; what is new comes first)
#     (`autosp plan --memory` for the longest length is not run here: it takes minutes of CPU for 16 layers)
#  7. with GPU_CHECK_ALL=1 (both measured on the first H200 run, 2026-12-04): Ulysses pack/unpack bandwidth against
#     a plain copy, and masked_attention's kernel: packed documents against plain causal at the same length
#
#  8. the kernels' scratch at held-out shapes (bench/cuda_workspace.py --parts heldout: batch 2, head dim 96, lengths
#     off the 128 grid), each formula's error printed (run after step 4). The main job's plan made from a meta trace
#     is `autosp plan --model llama-3.2-1b --sp 1 --gpu h200 --seq-len 32768 --memory-budget 0.3` on any machine
#
# Steps 3 and 4 exit non-zero (rc 3, "BROKEN PROMISE") when a measured peak is more than 0.1 % above its plan or above
# the same step planned from a meta trace for this GPU.
#
# First run: an H200, 2026-12-04, 422 s (bench/RESULTS.md, "The whole step on an H200").
#
# OUT_DIR holds: logs.tar.gz (every step's log), summary.txt, kernel_configs.json, attention_table.md,
# whole_step_table.md, offload_131k_table.md, step_table.md, and with GPU_CHECK_ALL a2a_table.md, masked_table.md.
# Each step has its own time limit inside a total budget (GPU_CHECK_BUDGET seconds, default 570); a step that runs out
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
BUDGET="${GPU_CHECK_BUDGET:-570}"
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
LIM=$(limit_for 150)   # both compile kernels: 90 s cut the tests on the first H200 run (alone: under 60 s)
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

# 3. the whole step on this GPU at 32K (bench/gpu_step.py): remat 1.0 / 0.5 / least, the least untiled,
#    offloaded, compiled (last: inductor's cold compile is the longest), each against its plan's peak and against
#    eager at 0.5. The full log is kept; the table is cut from it in the summary, so a step cut by its limit still
#    shows its rows.
STEP_CONFIGS="eager 1.0,eager 0.5,eager least,eager least untiled,offload 0.5 fast link,compiled 0.5"
STEP_CONFIGS+=",compiled offload 0.5 fast link"
GPU="${GPU_CHECK_GPU:-h200}"   # the GPU the meta plans are made for (autosp.remat.cost.GPUS)
run_step whole_step 240 "$PY" bench/gpu_step.py --seq 32768 --layers 4 --configs "$STEP_CONFIGS" \
  --out "$LOGS/whole_step" --gpu "$GPU"

# 4. the planner's own offload at the real link (the least at 131,072 tokens, 2 layers) against recomputing
run_step offload_131k 100 "$PY" bench/gpu_step.py --seq 131072 --layers 2 --out "$LOGS/offload_131k" \
  --configs "eager least,offload least" --gpu "$GPU"

# 8. held-out shapes for the scratch formulas (before the benchmarks: what the plan's promise rests on comes first)
#    and cuBLAS's kept workspaces (the first GEMM of a thread: the main job's +65.3 MiB is two of 32 MiB?)
run_step workspace_heldout 60 "$PY" bench/cuda_workspace.py --parts blas,heldout

# 5. quick autotuning of attention at one length (other lengths use the nearest tuned bucket), then the benchmarks
if [ -n "${GPU_CHECK_TUNE:-}" ]; then   # 40 s did not finish the backward's search on the first H200 run
  run_step autotune_attention 90 "$PY" bench/autotune.py --kernels fwd,bwd --seqs 16384 --rep-ms 25
fi
run_step table 60 "$PY" bench/bench_kernels.py table --out "$OUT/attention_table.md"

# 6. the main job on this GPU: `autosp train`, Llama 3.2 1B (16 layers) at 32K, bf16, AdamW, remat budget 0.3:
#    the predicted peak per rank against torch.cuda.max_memory_allocated, and the step time. Its checkpoint goes to
#    /dev/shm (a 1B model's AdamW state is about 20 GB; the disk's speed is not what is measured).
RUNS=/dev/shm; [ -w "$RUNS" ] || RUNS="$LOGS"
RUNS="$(mktemp -d "$RUNS/autosp_train.XXXX")"
run_step step 120 "$PY" -m autosp train --model llama-3.2-1b --sp 1 --device cuda --seq-len 32768 \
  --memory-budget 0.3 --steps 2 --out "$RUNS/run"
rm -rf "$RUNS"

if [ -n "${GPU_CHECK_ALL:-}" ]; then
  run_step a2a 30 "$PY" bench/bench_kernels.py a2a --out "$OUT/a2a_table.md"
  run_step masked 30 "$PY" bench/bench_kernels.py masked --out "$OUT/masked_table.md"
fi

for t in whole_step offload_131k; do
  sed -n '/^| configuration/,$p' "$LOGS/$t.log" > "$OUT/${t}_table.md" 2>/dev/null
  [ -s "$OUT/${t}_table.md" ] || grep '^{"config"' "$LOGS/$t.log" > "$OUT/${t}_table.md" 2>/dev/null
done
grep -E '^autosp train|predicted peak|trained steps|measured peak|Error|error' "$LOGS/step.log" | sed 's/\r.*//' \
  > "$OUT/step_table.md"

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
  sed -n '/^Held-out/,$p' "$LOGS/workspace_heldout.log" 2>/dev/null && echo
  [ -f "$OUT/whole_step_table.md" ] && cat "$OUT/whole_step_table.md" && echo
  [ -s "$OUT/offload_131k_table.md" ] && echo "131,072 tokens, 2 layers:" && cat "$OUT/offload_131k_table.md" && echo
  if [ -f "$OUT/attention_table.md" ]; then
    cat "$OUT/attention_table.md"
  else
    echo "attention table missing: the end of table.log:"
    tail -n 20 "$LOGS/table.log" 2>/dev/null
  fi
} | tee "$OUT/summary.txt"
[ "${#FAILED[@]}" = 0 ]

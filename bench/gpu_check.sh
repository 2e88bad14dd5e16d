#!/usr/bin/env bash
# GPU check of autosp's kernels: one command, installs nothing (no network needed), < 8 min on an H200.
#
#   bash bench/gpu_check.sh OUT_DIR        # from the repo root; the repo need not be pip-installed
#
#  1. environment (GPU, torch, triton)
#  2. correctness at real sizes against a float64 reference (bf16 / fp16 / fp32), in parallel with
#     the CUDA tests in tests/gpu/
#  3. quick autotuning (bench/autotune_attention.py, bench/autotune_a2a.py) into OUT_DIR/kernel_configs.json,
#     which the later steps read (AUTOSP_KERNEL_CONFIGS)
#  4. Ulysses pack/unpack bandwidth against a plain copy
#  5. TFLOP/s forward and backward against SDPA's FLASH and cuDNN backends (MHA and GQA 4:1, s 2k..32k,
#     d=128, causal, bf16) -- printed last
# Full logs: OUT_DIR/<step>.log. Each step has its own time limit so the whole stays under 8 minutes.
set -uo pipefail

OUT="${1:-bench/out/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export AUTOSP_KERNEL_CONFIGS="$OUT/kernel_configs.json"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # silence 3.9's warning; 3.6 ignores it
PY="${PYTHON:-python}"
START=$SECONDS
STATUS=()

run_step() {  # run_step NAME LIMIT_S CMD...: log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" = 124 ] && note=" TIMEOUT"
  STATUS+=("$name: rc=$rc$note ($((SECONDS - t0))s)")
  echo "   rc=$rc$note in $((SECONDS - t0))s; last lines:"
  tail -n 4 "$OUT/$name.log" | sed 's/^/   | /'
  return 0
}

run_step env 30 bash -c "nvidia-smi; $PY - <<'EOF'
import numpy, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU', 'numpy', numpy.__version__)
import triton
print('triton', triton.__version__)
import autosp.kernels
print('autosp.kernels imported')
EOF"

# 2. correctness: the real-size check and the CUDA unit tests compile different kernels: run them side by side.
echo "== check + pytest (parallel, limit 170s)"
t0=$SECONDS
timeout --kill-after=10 170 "$PY" bench/bench_kernels.py check >"$OUT/check.log" 2>&1 &
PID_CHECK=$!
timeout --kill-after=10 170 "$PY" -m pytest tests/gpu -q -p no:cacheprovider \
  >"$OUT/pytest_cuda.log" 2>&1 &
PID_TEST=$!
wait $PID_CHECK; RC_CHECK=$?
wait $PID_TEST; RC_TEST=$?
STATUS+=("check: rc=$RC_CHECK" "pytest_cuda: rc=$RC_TEST ($((SECONDS - t0))s for both)")
grep -E "ok|FAIL|PASSED|FAILED|triton ==" "$OUT/check.log" | sed 's/^/   | /'
tail -n 3 "$OUT/pytest_cuda.log" | sed 's/^/   | /'

# 3. quick autotuning at two lengths; other lengths use the nearest tuned bucket.
run_step autotune_attention 110 "$PY" bench/autotune_attention.py --seqs 4096,16384 --rep-ms 25
run_step autotune_a2a 30 "$PY" bench/autotune_a2a.py --s-locs 8192 --rep-ms 20

# 4, 5. benchmarks (tuned configs from step 3)
run_step a2a 40 "$PY" bench/bench_kernels.py a2a --out "$OUT/a2a_table.md"
run_step table 100 "$PY" bench/bench_kernels.py table --out "$OUT/attention_table.md"

echo
echo "== summary ($((SECONDS - START))s total; logs in $OUT)"
printf '   %s\n' "${STATUS[@]}"
echo
[ -f "$OUT/a2a_table.md" ] && cat "$OUT/a2a_table.md"
echo
if [ -f "$OUT/attention_table.md" ]; then
  cat "$OUT/attention_table.md"
else
  echo "attention table missing: see $OUT/table.log"
  tail -n 20 "$OUT/table.log"
fi

#!/usr/bin/env bash
# One GPU run: the GPU test suite, compute-sanitizer memcheck on a fast subset, and the benchmarks.
# Logs and JSON go under $OUT (the device tool's output folder; ./out elsewhere).
#
#   bash scripts/gpu_check.sh                     # everything
#   STAGES="tests bench" TESTS="tests/quant" BENCH="--module quant" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests sanitizer bench"}
TESTS=${TESTS:-tests}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
PYTEST_ARGS=${PYTEST_ARGS:-"-n 4"}  # several processes share the GPU; the Python side is the bottleneck
SANITIZER_TESTS=${SANITIZER_TESTS:-"tests/transpose tests/language"}
BENCH=${BENCH:-}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0

if [[ " $STAGES " == *" tests "* ]]; then
  echo "== GPU tests: $TESTS"
  timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider $PYTEST_ARGS $TESTS 2>&1 | tee "$OUT/tests.log" | tail -n 40
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=1
  echo "tests rc=$rc"
fi

if [[ " $STAGES " == *" sanitizer "* ]]; then
  echo "== compute-sanitizer memcheck: $SANITIZER_TESTS"
  # small shapes: the CPU grids run on the GPU too when TRITILE_SMALL_SHAPES=1
  TRITILE_SMALL_SHAPES=1 timeout 300 compute-sanitizer --tool memcheck --leak-check no --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider $SANITIZER_TESTS > "$OUT/sanitizer.log" 2>&1
  rc=$?; [ "$rc" -ne 0 ] && status=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -n 5
  echo "sanitizer rc=$rc"
fi

if [[ " $STAGES " == *" bench "* ]]; then
  echo "== benchmarks $BENCH"
  python3 -m tritile bench $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>/dev/null | tee "$OUT/bench.md"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=1
fi
exit $status

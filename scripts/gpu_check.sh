#!/usr/bin/env bash
# One GPU run, in stages: the GPU test suite at TileKernels' shapes (tests) and at the CPU's small ones (small),
# compute-sanitizer (memcheck over every module's GPU tests at the CPU's small shapes; racecheck and synccheck on the
# Gluon engram backward), the torch.compile tests under inductor, and the benchmarks.  Logs and JSON go under $OUT
# (the device tool's output folder; ./out elsewhere).
#
#   bash scripts/gpu_check.sh                                  # tests, sanitizers, compile tests, benchmarks
#   STAGES="tests bench" TESTS="tests/quant" BENCH="--module quant" bash scripts/gpu_check.sh
#   STAGES=memcheck PART=1/4 bash scripts/gpu_check.sh         # a quarter of the memcheck run
#   STAGES=memcheck MEMCHECK_JOBS=14 bash scripts/gpu_check.sh # 14 sanitizer processes at once, a file each
#   STAGES="racecheck synccheck compile" bash scripts/gpu_check.sh
#   STAGES=grid GRID_OPS="quant:per_channel_cast quant:cast_back" bash scripts/gpu_check.sh  # grids, JSON an op
#   STAGES=tests PYTEST_ARGS="-n 12" RETRY_FAILED=2 bash scripts/gpu_check.sh  # failures run again on 2 workers
#   STAGES=tune TUNE_SPECS="normalize_weight|'num_topk': 9;aux_fi" bash scripts/gpu_check.sh  # CUPTI tune sweeps
#   STAGES=multigpu DEEPEP=/tmp/deepep bash scripts/gpu_check.sh   # 2+ GPUs: multi-rank tests, DeepEP's, ep bench
#
# memcheck covers every tests/<module>/test_*.py (new modules are picked up by themselves); PART=i/n takes every
# n-th file from the i-th (1-based), so n calls cover all of them; MEMCHECK_JOBS=n runs n files at once.
# SANITIZER_TESTS overrides the file list.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests small memcheck racecheck synccheck compile bench"}
TESTS=${TESTS:-tests}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
PYTEST_ARGS=${PYTEST_ARGS:-"-n 4"}  # several processes share the GPU; the Python side is the bottleneck
PART=${PART:-1/1}
SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-540}
BENCH=${BENCH:-}

{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
    torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
# A test log's failures as they happened (-v names each test's outcome, so a run cut short by TEST_TIMEOUT still
# says which tests failed), then its summary
outcomes() {
  grep -aE "(FAILED|ERROR) +tests/|^(FAILED|ERROR) " "$1" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | head -n 40
  grep -aE "[0-9]+ (passed|failed)|Timeout|Terminated" "$1" | tail -n 3
  echo "$(grep -acE ' PASSED +tests/' "$1") tests passed by the time the log ends"
}

if has small; then
  # The CPU's small, odd shapes on the GPU (no sanitizer): the GPU's launch rules at widths its own test shapes
  # never reach (one or two elements a thread, partial tiles), where layout-specific compiler faults show
  echo "== GPU tests at the CPU's small shapes: $TESTS"
  TRITILE_SMALL_SHAPES=1 timeout "$TEST_TIMEOUT" python3 -m pytest -v -p no:cacheprovider $PYTEST_ARGS $TESTS \
    > "$OUT/small.log" 2>&1
  rc=$?; [ "$rc" -ne 0 ] && status=1
  outcomes "$OUT/small.log"
  echo "small rc=$rc"
fi

if has tests; then
  echo "== GPU tests: $TESTS"
  timeout "$TEST_TIMEOUT" python3 -m pytest -v -p no:cacheprovider $PYTEST_ARGS $TESTS > "$OUT/tests.log" 2>&1
  rc=$?
  outcomes "$OUT/tests.log"
  echo "tests rc=$rc"
  # the failed node ids, whole (a parametrize id may hold spaces), one a line
  mapfile -t failed < <(python3 -c 'import re, sys
ids = {m.group(2) for line in open(sys.argv[1], errors="replace")
       for m in [re.search(r"(FAILED|ERROR) +(tests/\S.*?)(?: - .*)?\s*$", line)] if m}
print("\n".join(sorted(ids)))' "$OUT/tests.log" | grep .)
  if [ "$rc" -ne 0 ] && [ -n "${RETRY_FAILED:-}" ] && [ "${#failed[@]}" -gt 0 ] && [ "$rc" -ne 124 ]; then
    # Many workers share one GPU's memory: a test that fails with OutOfMemoryError under -n N is run again with
    # RETRY_FAILED workers; the run passes only if every failed test then passes.
    echo "== ${#failed[@]} failed tests again with -n $RETRY_FAILED" \
      "($(grep -ac 'OutOfMemoryError' "$OUT/tests.log") OutOfMemoryError lines in the first log)"
    python3 -m pytest -v -p no:cacheprovider -n "$RETRY_FAILED" "${failed[@]}" > "$OUT/tests_retry.log" 2>&1
    rc=$?
    outcomes "$OUT/tests_retry.log"
    echo "retry rc=$rc"
  fi
  [ "$rc" -ne 0 ] && status=1
fi

memcheck_file() {  # $1: one test file; its log under $OUT/memcheck/
  local log="$OUT/memcheck/$(echo "$1" | tr / _).log" rc
  TRITILE_SMALL_SHAPES=1 timeout "$SANITIZER_TIMEOUT" compute-sanitizer --tool memcheck --leak-check no \
    --print-limit 20 --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider "$1" > "$log" 2>&1
  rc=$?
  echo "$1 rc=$rc $(grep -a 'ERROR SUMMARY' "$log" | tail -n 1 | tr -d '=') |" \
    "$(grep -aE '[0-9]+ (passed|failed)' "$log" | tail -n 1)"
  return $rc
}
export -f memcheck_file
export OUT SANITIZER_TIMEOUT

if has memcheck; then
  if [ -n "${SANITIZER_TESTS:-}" ]; then
    files=$SANITIZER_TESTS
  else
    i=${PART%/*}; n=${PART#*/}
    files=$(ls tests/*/test_*.py | LC_ALL=C sort | awk -v i="$i" -v n="$n" '(NR - i) % n == 0')
  fi
  jobs=${MEMCHECK_JOBS:-1}
  mkdir -p "$OUT/memcheck"
  # small shapes: the CPU grids run on the GPU when TRITILE_SMALL_SHAPES=1.  One sanitizer process per test file,
  # MEMCHECK_JOBS of them at once (the sanitizer's cost is mostly on the host; small shapes leave the GPU free)
  echo "== compute-sanitizer memcheck, part $PART: $(echo $files | wc -w) test files, $jobs at a time"
  echo $files | tr ' ' '\n' | xargs -P "$jobs" -I{} bash -c 'memcheck_file {}' > "$OUT/memcheck_summary.txt" 2>&1
  rc=$?; [ "$rc" -ne 0 ] && status=1
  sort "$OUT/memcheck_summary.txt"
  (cd "$OUT" && tar czf memcheck_logs.tgz memcheck && rm -rf memcheck)  # the device tool returns few files
  echo "memcheck rc=$rc (a file's rc 99: sanitizer errors; 124: out of time, split with PART=i/n)"
fi

for tool in racecheck synccheck; do
  if has $tool; then
    echo "== compute-sanitizer $tool: the one-pass Gluon engram backward (tritile.testing.engram_gluon_check)"
    timeout "$SANITIZER_TIMEOUT" compute-sanitizer --tool $tool --print-limit 20 --error-exitcode 99 \
      python3 -m tritile.testing.engram_gluon_check > "$OUT/$tool.log" 2>&1
    rc=$?; [ "$rc" -ne 0 ] && status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|ok|FAILED|cannot run" "$OUT/$tool.log" | tail -n 8
    echo "$tool rc=$rc"
  fi
done

if has compile; then
  echo "== torch.compile(fullgraph=True) tests under inductor (every module's tests named *compile*)"
  timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider tests -k "compile and not sm90" 2>&1 \
    | tee "$OUT/compile.log" | tail -n 15
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=1
  echo "compile rc=$rc"
fi

# One step of a stage bound by a deadline: $1 the stage's folder under $OUT (packed into $1.tgz after each step, so
# a stage cut short keeps its finished steps), $2 the deadline in seconds from $3 (the stage's start), $4 a label,
# $5 the step's log; the rest is the command, run under what is left of the deadline.  Returns 1 when too little is.
deadline_step() {
  local dir=$1 deadline=$2 t0=$3 label=$4 log=$5 left rc
  shift 5
  left=$(( deadline - ($(date +%s) - t0) ))
  [ "$left" -lt 30 ] && { echo "$dir: out of time before $label"; return 1; }
  timeout $((left - 10)) "$@" > "$log" 2>&1
  rc=$?; [ "$rc" -ne 0 ] && status=1
  echo "$dir $label rc=$rc $(( $(date +%s) - t0 )) s"
  (cd "$OUT" && tar czf "$dir.tgz" "$dir")
}

if has grid; then
  # TileKernels' benchmark grid, one op at a time (GRID_OPS: "module:op ..."), CUPTI timer only, a JSON each, until
  # GRID_DEADLINE seconds have passed: a grid cut by the deadline leaves the finished ops' JSON (packed in grids.tgz)
  echo "== benchmark grids: ${GRID_OPS:-none given}"
  mkdir -p "$OUT/grids"
  t0=$(date +%s)
  for mo in ${GRID_OPS:-}; do
    deadline_step grids "${GRID_DEADLINE:-540}" "$t0" "$mo" "$OUT/grids/${mo#*:}.md" \
      python3 -m tritile bench --module "${mo%%:*}" --op "${mo#*:}" --grid --cupti-only \
      --json "$OUT/grids/${mo#*:}.json" || break
  done
fi

if has tune; then
  # launch-config sweeps, CUPTI-ranked, over the grid cases a text picks: TUNE_SPECS="op|case text;op|case text"
  # (the case text as `tune --case` takes it; empty: every grid case of the op), a JSON and a log each, packed in
  # tunes.tgz, until TUNE_DEADLINE seconds
  echo "== tune sweeps: ${TUNE_SPECS:-none given}"
  mkdir -p "$OUT/tunes"
  t0=$(date +%s); i=0
  IFS=';' read -ra specs <<< "${TUNE_SPECS:-}"
  for spec in "${specs[@]}"; do
    op=${spec%%|*}; text=${spec#*|}; [ "$text" = "$spec" ] && text=""
    i=$((i + 1))
    deadline_step tunes "${TUNE_DEADLINE:-540}" "$t0" "$spec" "$OUT/tunes/$i-$op.log" \
      python3 -m tritile tune --op "$op" --grid --cupti ${text:+--case "$text"} --json "$OUT/tunes/$i-$op.json" \
      || break
  done
fi

if has multigpu; then
  # Several GPUs of one host (NCCL, NVLink multicast off): tritile's multi-rank tests on NCCL, DeepEP's own tests
  # against tritile.ep with one rank per GPU (DEEPEP: a DeepEP checkout at dd758ca, carried in), and the multi-rank
  # dispatch / combine benchmark against all_to_all_single in the same run.
  export NCCL_NVLS_ENABLE=0
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  echo "== multi-GPU: $ngpu GPUs"
  timeout "$TEST_TIMEOUT" python3 -m pytest -v -p no:cacheprovider tests/ep tests/modeling > "$OUT/multigpu_tests.log" 2>&1
  rc=$?; [ "$rc" -ne 0 ] && status=1
  outcomes "$OUT/multigpu_tests.log"
  if [ -n "${DEEPEP:-}" ]; then
    bash scripts/deepep_tests.sh "$DEEPEP" --gpu --ranks "$ngpu" --out "$OUT/deepep" || status=1
  fi
  timeout "$TEST_TIMEOUT" python3 -m tritile bench --module ep --ranks "$ngpu" --json "$OUT/ep_ranks.json" \
    2>"$OUT/ep_ranks.err" | tee "$OUT/ep_ranks.md"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=1
fi

if has bench; then
  echo "== benchmarks $BENCH"
  python3 -m tritile bench $BENCH --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>/dev/null | tee "$OUT/bench.md"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && status=1
fi
exit $status

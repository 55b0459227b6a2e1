#!/usr/bin/env bash
# One device call on a 2-GPU machine, everything in parallel, logs packed into $OUT/results.tgz:
#   GPU 0: the GPU tests of $TESTS0 (then $TESTS0B, with $NPROC0B workers: the big files need ~40 GB each);
#   GPU 1: `tune --compile-only` of every op in $OPS (parallel processes: fills Triton's cache and checks each
#          candidate's bits; on GPU 0 beside the tests with COMPILE_GPU=0), then the probe command $EXTRA1 and
#          `python -m tritile bench --quick` of $BENCH_OPS if set (timings: nothing else runs on GPU 1 then);
#   then both GPUs time the tune candidates of $OPS (two shards; TUNE_ARGS=--cupti ranks by CUPTI time with L2
#   flushed; COMPILE_ARGS=--quick with TUNE_ARGS="--cupti --quick": the quick cases only), and GPU 0 runs compute-sanitizer memcheck
#   on $SANITIZER0 (the CPU's small shapes) in the time left.  Budget in seconds: $BUDGET.
# On a 1-GPU machine "GPU 1" is GPU 0 and every timing (probe, bench, sweep: one shard) waits for the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${BUDGET:-500}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')" | tee "$R/env.txt"

NG=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "${NG:-0}" -ge 2 ]; then G1=1; else G1=0; fi
if [ -n "${TESTS0:-}" ]; then
  ( CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_S:-300} python3 -m pytest -v -rf -p no:cacheprovider -n ${NPROC0:-10} \
      $TESTS0 > "$R/tests0.log" 2>&1; rc=$?; echo "tests0 rc=$rc at $(( $(date +%s) - start )) s" >> "$R/tests0.log"
    # a timeout kills pytest but not its xdist workers, which keep their GPU memory: kill them (only GPU 0 runs pytest)
    [ $rc -eq 124 ] && pkill -9 -f "exec(eval(sys.stdin.readline()))"
    # $TESTS0B: a second batch in the time left (its own log, so the first batch's summary is kept)
    if [ -n "${TESTS0B:-}" ]; then
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 15 )) python3 -m pytest -v -rf -p no:cacheprovider \
        -n ${NPROC0B:-${NPROC0:-10}} $TESTS0B > "$R/tests0b.log" 2>&1
      echo "tests0b rc=$? at $(( $(date +%s) - start )) s" >> "$R/tests0b.log"
    fi ) &
  tests0=$!
fi
( i=0; cp=()
  for op in ${OPS:-}; do
    ( CUDA_VISIBLE_DEVICES=$([ "${COMPILE_GPU:-1}" = 1 ] && echo $G1 || echo 0) timeout ${COMPILE_S:-220} python3 -m tritile tune --compile-only --op $op ${COMPILE_ARGS:-} \
        > "$R/compile_$op.log" 2>&1 ) &
    cp+=($!); i=$((i+1)); if (( i % ${COMPILE_PROCS:-12} == 0 )); then wait "${cp[@]}"; cp=(); fi
  done; wait ) &
compile=$!
# COMPILE_GPU=1 (default): the compile processes run full-size cases on GPU 1, away from the tests' memory, and
# the timings below wait for them; COMPILE_GPU=0: beside the tests (risks OutOfMemoryError in big test files)
[ "${COMPILE_GPU:-1}" = 1 ] && wait $compile
# one GPU: nothing is timed while the tests run
[ "$G1" = 0 ] && [ -n "${TESTS0:-}" ] && wait $tests0

if [ -n "${EXTRA1:-}" ]; then
  CUDA_VISIBLE_DEVICES=$G1 timeout ${EXTRA1_S:-120} bash -c "$EXTRA1" > "$R/extra1.log" 2>&1
  echo "extra1 rc=$? at $(( $(date +%s) - start )) s" >> "$R/extra1.log"
fi
if [ -n "${BENCH_OPS:-}" ]; then  # "all": every registered op
  CUDA_VISIBLE_DEVICES=$G1 timeout ${BENCH_S:-200} python3 -m tritile bench --quick \
    $([ "$BENCH_OPS" = all ] || for op in $BENCH_OPS; do echo --op $op; done) \
    --json "$R/bench.json" > "$R/bench.md" 2> "$R/bench.err"; echo "bench rc=$? at $(( $(date +%s) - start )) s" >> "$R/bench.md"
fi
wait $compile
echo "compile phase done at $(( $(date +%s) - start )) s"
if [ -n "${OPS:-}" ] && [ "$G1" = 0 ]; then  # one GPU: one shard
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - ${SAN0_S:-0} - 15 )) python3 -m tritile tune \
    $(for op in $OPS; do echo --op $op; done) ${TUNE_ARGS:-} --top 6 --json "$R/tune0.json" > "$R/tune0.txt" 2>&1
elif [ -n "${OPS:-}" ]; then
  ( CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 15 )) python3 -m tritile tune $(for op in $OPS; do echo --op $op; done) \
      --shard 0/2 ${TUNE_ARGS:-} --top 6 --json "$R/tune1.json" > "$R/tune1.txt" 2>&1 ) &
  t1=$!
fi
[ -n "${TESTS0:-}" ] && [ -n "${OPS:-}" ] && [ "$G1" = 1 ] && wait $tests0
if [ -n "${OPS:-}" ] && [ "$G1" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - ${SAN0_S:-0} - 15 )) python3 -m tritile tune \
    $(for op in $OPS; do echo --op $op; done) --shard 1/2 ${TUNE_ARGS:-} --top 6 --json "$R/tune0.json" > "$R/tune0.txt" 2>&1
fi
if [ -n "${SANITIZER0:-}" ] && (( $(left) > 40 )); then
  CUDA_VISIBLE_DEVICES=0 TRITILE_SMALL_SHAPES=1 timeout $(( $(left) - 12 )) compute-sanitizer --tool memcheck \
    --leak-check no --print-limit 20 python3 -m pytest -q -p no:cacheprovider $SANITIZER0 > "$R/sanitizer0.log" 2>&1
  echo "sanitizer0 rc=$?" >> "$R/sanitizer0.log"
fi
[ -n "${OPS:-}" ] && [ "$G1" = 1 ] && wait $t1
[ -n "${TESTS0:-}" ] && wait $tests0
# $EXTRA1B: a second probe on GPU 1 after the benchmark and the sweeps
[ -n "${EXTRA1B:-}" ] && CUDA_VISIBLE_DEVICES=$G1 timeout $(( $(left) - 10 )) bash -c "$EXTRA1B" >> "$R/extra1.log" 2>&1
tar -czf "$OUT/results.tgz" -C "$R" .
echo "== extra1"; [ -f "$R/extra1.log" ] && tail -40 "$R/extra1.log"
grep -h "BAD\|DEFAULT" "$R"/compile_*.log 2>/dev/null | grep -v "passes the op's check" | head -20
for f in tune1 tune0; do [ -f "$R/$f.txt" ] && { echo "== $f"; grep -v "BAD\|^# " "$R/$f.txt" | head -120; }; done
[ -f "$R/bench.md" ] && { echo "== bench"; grep -v "^|---" "$R/bench.md" | cut -c1-240; }
for f in tests0 tests0b sanitizer0; do [ -f "$R/$f.log" ] && { echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$R/$f.log" | tail -4
  grep -m5 -E "Invalid|out of bounds" "$R/$f.log"; grep -E "^FAILED|^ERROR|\] FAILED|\] ERROR" "$R/$f.log" | sort -u | head -30; }; done

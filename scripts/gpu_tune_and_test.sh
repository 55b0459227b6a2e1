#!/usr/bin/env bash
# One device call on a 2-GPU machine: GPU 0 runs the GPU tests of $TESTS0 while GPU 1 first fills Triton's
# cache with every tune candidate (parallel compile-only processes), then times them (`python -m tritile
# tune`), then runs the tests of $TESTS1.  Logs and JSON are packed into $OUT/results.tgz.  Budget in seconds: $BUDGET.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; R=$(mktemp -d)  # logs go to $R, packed into $OUT/results.tgz at the end
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${BUDGET:-570}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
TESTS0=${TESTS0:-tests/quant}
TESTS1=${TESTS1-"tests/moe tests/engram"}  # set but empty: no TESTS1 stage
COMPILE_PROCS=${COMPILE_PROCS:-12}
OPS=${OPS:-"per_token_cast per_block_cast per_token_cast_back per_channel_cast per_channel_cast_fused per_channel_cast_and_transpose per_token_cast_to_e5m6 cast_back_e5m6 per_block_cast_lossless swiglu_forward_and_per_token_cast swiglu_backward_and_per_token_cast swiglu_forward_and_per_channel_cast_and_transpose get_fused_mapping expand_to_fused expand_to_fused_with_sf reduce_fused topk_gate normalize_weight aux_fi fused_weight engram_gate_fwd engram_gate_bwd engram_hash transpose batched_transpose"}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')" | tee "$R/env.txt"

( CUDA_VISIBLE_DEVICES=0 timeout $(( BUDGET - ${SAN0_S:-0} - 20 )) python3 -m pytest -v -rf -p no:cacheprovider \
    -n ${NPROC0:-4} $TESTS0 ${K0:+-k "$K0"} > "$R/tests0.log" 2>&1; echo "tests0 rc=$?" >> "$R/tests0.log"
  # $SANITIZER0: compute-sanitizer memcheck on GPU 0 after its tests (CPU's small shapes), in the time left
  if [ -n "${SANITIZER0:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 TRITILE_SMALL_SHAPES=1 timeout $(( $(left) - 12 )) compute-sanitizer --tool memcheck \
      --leak-check no --print-limit 20 python3 -m pytest -q -p no:cacheprovider $SANITIZER0 > "$R/sanitizer0.log" 2>&1
    echo "sanitizer0 rc=$?" >> "$R/sanitizer0.log"
  fi ) &
tests0=$!

# optional probes first, on GPU 1 ($EXTRA1: a command line, e.g. "python3 scripts/copy_size_probe.py")
if [ -n "${EXTRA1:-}" ]; then
  CUDA_VISIBLE_DEVICES=1 timeout ${EXTRA1_S:-120} bash -c "$EXTRA1" > "$R/extra1.log" 2>&1; echo "extra1 rc=$?" >> "$R/extra1.log"
  echo "== extra1"; cat "$R/extra1.log" | tail -40
fi

# phase 1: compile (and check) every candidate, ops spread over processes
i=0; pids=()
for op in $OPS; do
  ( CUDA_VISIBLE_DEVICES=1 timeout ${COMPILE_S:-200} python3 -m tritile tune --compile-only --op $op \
      > "$R/compile_$op.log" 2>&1 ) &
  pids+=($!); i=$((i+1))
  if (( i % COMPILE_PROCS == 0 )); then wait "${pids[@]}"; pids=(); fi
done
wait "${pids[@]}" 2>/dev/null
echo "compile phase done at $(( $(date +%s) - start )) s"; grep -h "BAD" "$R"/compile_*.log | head -40

# phase 2: timing, one process, whatever the budget allows (leaving 150 s for TESTS1)
CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - ${RESERVE1:-150} )) python3 -m tritile tune $(for op in $OPS; do echo --op $op; done) \
  --top 5 --json "$R/tune.json" > "$R/tune.txt" 2>&1
echo "tune done at $(( $(date +%s) - start )) s"; grep -v "^   BAD" "$R/tune.txt" | head -150

if [ -n "$TESTS1" ]; then
  CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - ${SAN_S:-0} - 10 )) python3 -m pytest -v -rf -p no:cacheprovider -n 4 $TESTS1 \
    ${K1:+-k "$K1"} > "$R/tests1.log" 2>&1; echo "tests1 rc=$?" >> "$R/tests1.log"
fi
# compute-sanitizer memcheck on a fast subset at the CPU's small shapes
if [ -n "${SANITIZER_TESTS:-}" ]; then
  CUDA_VISIBLE_DEVICES=1 TRITILE_SMALL_SHAPES=1 timeout $(( $(left) - 8 )) compute-sanitizer --tool memcheck \
    --leak-check no --print-limit 20 python3 -m pytest -q -p no:cacheprovider $SANITIZER_TESTS ${KS:+-k "$KS"} \
    > "$R/sanitizer.log" 2>&1; echo "sanitizer rc=$?" >> "$R/sanitizer.log"
fi
wait $tests0
for f in tests0 tests1 sanitizer sanitizer0; do [ -f "$R/$f.log" ] && { echo "== $f"; grep -E "passed|failed|rc=|ERROR SUMMARY" "$R/$f.log" | tail -4; grep -m5 -E "Invalid|out of bounds" "$R/$f.log"; grep -E "^FAILED|^ERROR|\] FAILED|\] ERROR" "$R/$f.log" | sort -u | head -30; }; done
tar -czf "$OUT/results.tgz" -C "$R" .

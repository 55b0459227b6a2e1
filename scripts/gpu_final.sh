#!/usr/bin/env bash
# One device call on a 2-GPU machine: GPU 0 runs the quant and language GPU tests; GPU 1 runs the quick
# benchmark (CUPTI + graph timing), then the other modules' GPU tests.  Everything lands in $OUT/results.tgz
# (one file: the device tool returns few files) and a summary on stdout.  Budget in seconds: $BUDGET.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; R=$(mktemp -d); mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
BUDGET=${BUDGET:-540}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
N0=${N0:-6}; N1=${N1:-6}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'GPUs')" | tee "$R/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$R/env.txt"

( CUDA_VISIBLE_DEVICES=0 timeout $(( BUDGET - 15 )) python3 -m pytest -q -p no:cacheprovider -n $N0 \
    ${TESTS0:-tests/language tests/quant} -k "${K0:-not tune_candidates and not launch_configs}" > "$R/tests0.log" 2>&1
  echo "tests0 rc=$?" >> "$R/tests0.log"
  if (( $(left) > 40 )); then
    CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -n $N0 tests/quant \
      -k "tune_candidates or launch_configs" > "$R/tests0b.log" 2>&1; echo "tests0b rc=$?" >> "$R/tests0b.log"
  fi ) &
t0=$!

CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_S:-300} python3 -m tritile bench --quick --json "$R/bench.json" \
  > "$R/bench.md" 2> "$R/bench.err"; echo "bench rc=$? at $(( $(date +%s) - start )) s" | tee -a "$R/bench.md"
CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -n $N1 \
  ${TESTS1:-tests/moe tests/engram tests/transpose tests/core} > "$R/tests1.log" 2>&1; echo "tests1 rc=$?" >> "$R/tests1.log"
wait $t0
tar -czf "$OUT/results.tgz" -C "$R" .
echo "== bench"; grep -v "^|---" "$R/bench.md" | cut -c1-260
for f in tests0 tests0b tests1; do [ -f "$R/$f.log" ] && { echo "== $f"; grep -E "passed|failed|rc=" "$R/$f.log" | tail -3; grep -E "^FAILED|^ERROR" "$R/$f.log" | head -25; }; done

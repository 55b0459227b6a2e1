#!/usr/bin/env bash
# DeepEP's own tests against tritile.ep: tests/legacy/test_intranode.py, tests/legacy/test_low_latency.py and every
# tests/elastic/test_*.py of a DeepEP checkout (commit dd758ca), with `import deep_ep` resolving to tritile.ep.
#
#   bash scripts/deepep_tests.sh DEEPEP_DIR [--cpu | --gpu] [--ranks "2 3"] [--only "test_ep test_pp"] [--out DIR]
#
# --cpu (default without a GPU): gloo ranks on the CPU, 2 and 3 of them, at small shapes (passed through the
#       tests' own options); --gpu: one rank per GPU (default 1) with NCCL, at the tests' default shapes.
# Nothing is fetched: DEEPEP_DIR is a checkout (e.g. `git -C <mirror> archive dd758ca | tar -x -C /tmp/deepep`).
# The run builds an import-shim folder in a temporary directory (tests/ep/deepep_shim plus DeepEP's own
# deep_ep/utils/*.py, unchanged) and changes only the environment: device (TRITILE_DEEPEP_DEVICE=cpu maps the
# tests' "cuda" tensors to the CPU), backend (TRITILE_DEEPEP_BACKEND=gloo), world size (--num-processes), shapes on
# the CPU, EP_USE_NVIDIA_TOOLS=1 (DeepEP's switch that skips its CUPTI timing of DeepEP's own kernel names; not
# for test_barrier on a GPU, whose only work is inside that timing: a CPU-only torch has no CUDA profiler) and
# --skip-perf-test for test_ep (its timing reads those kernel names too).  The tests' checks are untouched.
#
# Logs and summary.md go to --out (default: $OUT if set, else ./deepep_out).  A test is PASS when it exits 0;
# "PASS (checks)" when every check ran and passed and the test then stopped in a section that needs hardware or
# DeepEP's kernels (named in the summary); FAIL otherwise (the exit status is 1 if any test failed).
set -u -o pipefail

usage() { sed -n '2,20p' "$0"; exit 2; }
[ $# -ge 1 ] || usage
DEEPEP=$(cd "$1" && pwd) || usage
shift
MODE=""
RANKS=""
ONLY=""
OUTDIR="${OUT:-$PWD/deepep_out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --gpu) MODE=gpu ;;
    --ranks) RANKS="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --out) OUTDIR="$2"; shift ;;
    *) usage ;;
  esac
  shift
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
[ -z "${PYTHON:-}" ] && [ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
if [ -z "$MODE" ]; then
  if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then MODE=gpu; else MODE=cpu; fi
fi
[ -n "$RANKS" ] || { [ "$MODE" = cpu ] && RANKS="2 3" || RANKS="1"; }
for f in tests/legacy/test_intranode.py tests/legacy/test_low_latency.py tests/elastic/test_ep.py deep_ep/utils/refs.py; do
  [ -f "$DEEPEP/$f" ] || { echo "not a DeepEP checkout (missing $f): $DEEPEP" >&2; exit 2; }
done
mkdir -p "$OUTDIR"
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
cp -r "$REPO/tests/ep/deepep_shim/." "$SHIM/"
mkdir -p "$SHIM/deep_ep/utils"
cp "$DEEPEP"/deep_ep/utils/*.py "$SHIM/deep_ep/utils/"
rm -f "$SHIM/README.md"

export PYTHONPATH="$SHIM:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$MODE" = cpu ]; then
  export TRITILE_DEEPEP_DEVICE=cpu TRITILE_DEEPEP_BACKEND=gloo TORCHDYNAMO_DISABLE=1
  unset TRITON_INTERPRET  # CPU tensors take tritile.ep's pure-torch twins of its kernels
  TIMEOUT=${TIMEOUT:-1800}
else
  TIMEOUT=${TIMEOUT:-600}
fi

# name | directory | arguments (CPU) | arguments (GPU) | marker printed once every check passed | minimum ranks
# (test_intranode's "[tuning]" loop after its checks is timing only: ~5000 timed calls, each after a 256 MiB
# cache flush, which a loaded CPU may not finish within TIMEOUT_TIMING seconds)
TESTS=(
  "test_intranode|legacy|--num-tokens 64 --hidden 256 --num-topk 4 --num-experts 24||[tuning]|1"
  "test_low_latency|legacy|--num-tokens 64 --hidden 1024 --num-topk 6 --num-experts 48||Dispatch + combine bandwidth|1"
  "test_ep|elastic|--num-tokens 32 --hidden 256 --num-topk 4 --num-experts 24 --skip-perf-test|--skip-perf-test||1"
  "test_ep_sync_free|elastic|--num-tokens 32 --hidden 256 --num-topk 4 --num-experts 24 --skip-perf-test --do-cpu-sync 0 --allow-multiple-reduction 0 --masked-ratio 0.25|--skip-perf-test --do-cpu-sync 0 --allow-multiple-reduction 0 --masked-ratio 0.25||1"
  "test_ep_deterministic|elastic|--num-tokens 32 --hidden 256 --num-topk 4 --num-experts 24 --skip-perf-test --deterministic --unbalanced-ratio 2 --test-first-only|--skip-perf-test --deterministic --unbalanced-ratio 2||1"
  "test_engram|elastic|--num-entries 2048 --hidden 128 --num-tokens 64 --num-entries-per-token 8|||1"
  "test_engram_fp8|elastic|--num-entries 2048 --hidden 256 --num-tokens 64 --num-entries-per-token 8 --use-fp8|--use-fp8||1"
  "test_pp|elastic|--num-tokens 64 --hidden 256 --num-stress-iterations 2 --num-sends 64||All stress tests passed|2"
  "test_agrs|elastic|--num-stress-iterations 1|||1"
  "test_barrier|elastic||||1"
)
# tests/elastic/test_*.py that the table above does not name still run, with their defaults
for f in "$DEEPEP"/tests/elastic/test_*.py; do
  n=$(basename "$f" .py)
  printf '%s\n' "${TESTS[@]}" | cut -d'|' -f1 | grep -qx "$n" || TESTS+=("$n|elastic||||1")
done

SUMMARY="$OUTDIR/summary.md"
{
  echo "# DeepEP's tests against tritile.ep"
  echo
  # a DeepEP archive unpacked inside another git work tree has no commit of its own: git -C would name that tree's
  echo "DeepEP: $( [ -e "$DEEPEP/.git" ] && git -C "$DEEPEP" rev-parse --short HEAD 2>/dev/null || echo "checkout at $DEEPEP (not a git checkout: the archive of dd758ca the script expects)"); tritile: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null); mode: $MODE; $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "| test | ranks | result | seconds | note |"
  echo "|---|---|---|---|---|"
} > "$SUMMARY"
FAILED=0
PORT=$((29500 + RANDOM % 2000))
for entry in "${TESTS[@]}"; do
  IFS='|' read -r name dir cpu_args gpu_args marker min_ranks <<< "$entry"
  script="${name%_sync_free}"; script="${script%_deterministic}"; script="${script%_fp8}"
  if [ -n "$ONLY" ] && ! printf '%s\n' $ONLY | grep -qx -e "$name" -e "$script"; then continue; fi
  [ -f "$DEEPEP/tests/$dir/$script.py" ] || continue
  for r in $RANKS; do
    log="$OUTDIR/${name}_${MODE}_${r}.log"
    if [ "$r" -lt "$min_ranks" ]; then
      echo "| $name | $r | N/A | 0 | needs at least $min_ranks ranks (a ring of neighbours) |" >> "$SUMMARY"
      continue
    fi
    args="$cpu_args"; [ "$MODE" = gpu ] && args="$gpu_args"
    tools=1; [ "$script" = test_barrier ] && [ "$MODE" = gpu ] && tools=0
    PORT=$((PORT + 1))
    start=$(date +%s)
    limit=$TIMEOUT
    [ "$MODE" = cpu ] && [ "$script" = test_intranode ] && limit=${TIMEOUT_TIMING:-900}
    (cd "$DEEPEP/tests/$dir" && MASTER_PORT=$PORT EP_USE_NVIDIA_TOOLS=$tools \
       timeout "$limit" $PY "$script.py" --num-processes "$r" $args) > "$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    result=$($PY - "$log" "$rc" "$marker" "$r" <<'EOF'
import re, sys
log, rc, marker, ranks = open(sys.argv[1], errors="replace").read(), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
last = [l for l in log.splitlines() if re.match(r"^\w*(Error|Exception)\b", l)]
if rc == 0:
    print("PASS|")
elif rc == 124 and marker and marker in log and "AssertionError" not in log:
    print(f"PASS (checks)|every check passed; the timing loop after them did not finish within the time limit")
elif marker and log.count(marker) >= 1 and "AssertionError" not in log:
    why = last[-1] if last else f"exit {rc}"
    if "bench_kineto" in log or "dispatch_t[0]" in log:
        why = "stopped in the CUPTI timing of DeepEP's own kernel names (bench_kineto): " + why
    elif "get_rdma_gbs" in log or "num_approx_rdma_cycles" in log:
        why = "stopped in the timing section, which divides by the InfiniBand rate from ibstat (none here): " + why
    print("PASS (checks)|" + why.replace("|", "/"))
elif rc == 124:
    print("FAIL|timed out")
else:
    print("FAIL|" + (last[-1] if last else f"exit {rc}").replace("|", "/"))
EOF
)
    status=${result%%|*}; note=${result#*|}
    [ "$status" = FAIL ] && FAILED=1
    echo "| $name | $r | $status | $secs | $note |" >> "$SUMMARY"
    echo "$name ranks=$r: $status ($secs s) $note"
  done
done
if [ "$MODE" = gpu ]; then
  # the low-latency figure of DeepEP's test (CUDA events, dispatch + combine), with and without tritile's
  # cross-rank header checks (TRITILE_EP_PEER_CHECKS=0: no header exchange, no host sync in the calls)
  for r in $RANKS; do
    [ -f "$OUTDIR/test_low_latency_${MODE}_${r}.log" ] || continue  # only after test_low_latency ran
    for checks in 1 0; do
      log="$OUTDIR/test_low_latency_${MODE}_${r}_checks${checks}.log"
      [ "$checks" = 1 ] && [ -f "$OUTDIR/test_low_latency_${MODE}_${r}.log" ] && cp "$OUTDIR/test_low_latency_${MODE}_${r}.log" "$log"
      if [ "$checks" = 0 ]; then
        PORT=$((PORT + 1))
        (cd "$DEEPEP/tests/legacy" && MASTER_PORT=$PORT EP_USE_NVIDIA_TOOLS=1 TRITILE_EP_PEER_CHECKS=0 \
           timeout "$TIMEOUT" $PY test_low_latency.py --num-processes "$r") > "$log" 2>&1
      fi
      line=$(grep -m1 "Dispatch + combine bandwidth" "$log" 2>/dev/null || echo "no figure (see $log)")
      echo "- LL dispatch + combine, $r rank(s), TRITILE_EP_PEER_CHECKS=$checks: ${line#*] }" >> "$SUMMARY"
    done
  done
fi
echo
cat "$SUMMARY"
exit $FAILED

#!/usr/bin/env bash
# Before spending GPU time: run the CPU suite with the GPU's launch configs, recording every kernel variant,
# then compile each variant for sm_90 with Triton's bundled ptxas (no GPU needed).  ~25 minutes on 2 cores.
#   bash scripts/compile_check.sh [pytest args, e.g. tests/quant]
set -euo pipefail
cd "$(dirname "$0")/.."
log=${LAUNCHES:-/tmp/tritile-launches.jsonl}
rm -f "$log"
TRITON_INTERPRET=1 TRITILE_GPU_CONFIGS=1 TRITILE_RECORD_LAUNCHES="$log" python -m pytest -q -n 2 "${@:-tests}"
env -u TRITON_INTERPRET python -u -m tritile.testing.compile_check "$log"

#!/usr/bin/env bash
# tritile and TileKernels side by side, TileKernels natively in the same process: on TileKernels' own benchmark items
# (`bench --quick`: each op's representative case, one or two per test file of TileKernels' tests/{quant,moe,engram,
# transpose}), kernel time (CUPTI, L2 flushed; TileKernels' timer) and eager time per call (100 back-to-back calls, one
# synchronize, best of 5), for both on the same inputs.  Writes under $OUT: bench_tk.json, bench_tk.md (the run's
# tables), bench_tk_results.md (`scripts/results_md.py --side`: RESULTS.md sections) and bench_tk.err.
#
# On the GPU machine, from the project root, with carry=[".tk"] (../shared/tools/tk_native/build.sh builds .tk/):
#   TRITILE_COMMIT=$(git rev-parse --short HEAD) bash scripts/bench_tk.sh     # the commit, named here: no git there
#   MODULES="mhc" bash scripts/bench_tk.sh                    # other modules (mhc: TileKernels' ops, no benchmark)
#   SELECT="--grid" MODULES=moe bash scripts/bench_tk.sh --op topk_gate   # a whole grid; extra args go to bench
# WARM (default 8): processes that first run every case once, untimed (TileLang compiles ~5 s a kernel, into
# ~/.tilelang/cache; Triton into ~/.triton/cache).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
TK=${TK:-.tk}
[ -d "$TK/TileKernels/tile_kernels" ] || { echo "no $TK/TileKernels: build .tk with ../shared/tools/tk_native/build.sh and carry it"; exit 2; }
T=${TMPDIR:-/tmp}
[ -d "$T/tk_site/tilelang" ] || { mkdir -p "$T/tk_site" && tar -xJf "$TK/tl_site.tar.xz" -C "$T/tk_site"; }
export LD_LIBRARY_PATH=$T/tk_site/z3/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$T/tk_site:$(cd "$TK/TileKernels" && pwd):$PWD${PYTHONPATH:+:$PYTHONPATH}
export TILEKERNELS_COMMIT=${TILEKERNELS_COMMIT:-36d9e45}  # the commit tools/tk_native/build.sh pins
export TRITILE_COMMIT=${TRITILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
NAME=${NAME:-bench_tk}
args=()
for m in ${MODULES:-quant moe engram transpose}; do args+=(--module "$m"); done
# the real TileKernels, not the shim that maps tile_kernels onto tritile
python -c "import tile_kernels.quant as q; assert not q.__name__.startswith('tritile'), q.__name__"
start=$(date +%s)
python -m tritile bench "${args[@]}" ${SELECT:---quick} --cupti-only --eager --against tilekernels \
    --warm-procs "${WARM:-8}" --json "$OUT/$NAME.json" "$@" 2> "$OUT/$NAME.err" | tee "$OUT/$NAME.md"
python scripts/results_md.py --side "$OUT/$NAME.json" > "$OUT/${NAME}_results.md"
echo "bench_tk: $(( $(date +%s) - start )) s; $OUT/$NAME.json, $OUT/$NAME.md, $OUT/${NAME}_results.md"

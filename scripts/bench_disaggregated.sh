#!/usr/bin/env bash
# Week 21 (issue 35): a disaggregated pair (1 prefill + 1 decode instance, `serve --disaggregated`)
# against two colocated replicas (`--data-parallel-size 2`) on the same two GPUs, one `bench serving`
# process per layout, the two alternated, ROUNDS times (medians of separate processes, never the best
# run), each with a time limit that names the run that hung.
#
#   scripts/bench_disaggregated.sh OUT_DIR ROUNDS MODEL LENGTHS OUTPUTS RATES REQUESTS [CONNECTOR]
#   e.g. scripts/bench_disaggregated.sh /tmp/pd 3 /tmp/l1b 2048,4096 128,256 4,16,32 64 nccl
#
# More bench options (e.g. --device cpu) in BENCH_ARGS.
# Results: OUT_DIR/<round>-<pd|dp2>.json (bench serving's), OUT_DIR/<round>-<layout>.txt (its output),
# and at the end a table: per rate and layout, the median over the rounds (lowest-highest) of TTFT p50,
# ITL p99 and, for the pair, the milliseconds a KV transfer took.
set -uo pipefail
out=$1 rounds=$2 model=$3 lengths=$4 outputs=$5 rates=$6 requests=$7 connector=${8:-nccl}
mkdir -p "$out"
limit=${BENCH_TIMEOUT:-300}
port=${BENCH_PORT:-8600}
for i in $(seq 1 "$rounds"); do
    for layout in pd dp2; do
        if [ "$layout" = pd ]; then extra=(--server-args "--disaggregated --kv-connector $connector")
        else extra=(--data-parallel-size 2); fi
        echo "== round $i, $layout"
        timeout "$limit" python3 -m nanoserve.cli bench serving --model "$model" --lengths "$lengths" \
            --output-len "$outputs" --rates "$rates" --requests "$requests" --port "$port" "${extra[@]}" \
            ${BENCH_ARGS:-} --out "$out/run-$i-$layout" > "$out/$i-$layout.txt" 2>&1
        code=$?
        [ "$code" -eq 124 ] && echo "!! round $i, $layout hung (killed after $limit s)"
        [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && echo "!! round $i, $layout failed (exit $code)"
        cp "$out/run-$i-$layout/serving.json" "$out/$i-$layout.json" 2>/dev/null
        pkill -f "nanoserve.cli serve --model" 2>/dev/null; sleep 2  # a server a killed run left behind
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
cells = {}
for path in sorted(Path(sys.argv[1]).glob("*-*.json")):
    layout = path.stem.split("-", 1)[1]
    for row in json.loads(path.read_text())["rows"]:
        for key in ("ttft_p50_ms", "itl_p99_ms", "kv_ms_per_transfer"):
            if row.get(key) is not None:
                cells.setdefault((row["rate"], layout, key), []).append(row[key])
def cell(rate, layout, key):
    v = cells.get((rate, layout, key))
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) n={len(v)}" if v else "-"
print(f"{'req/s':>6} {'layout':>6} {'TTFT p50 ms':>26} {'ITL p99 ms':>26} {'KV ms a transfer':>26}")
for rate in sorted({r for r, _, _ in cells}):
    for layout in ("dp2", "pd"):
        print(f"{rate:>6g} {layout:>6} {cell(rate, layout, 'ttft_p50_ms'):>26} {cell(rate, layout, 'itl_p99_ms'):>26} "
              f"{cell(rate, layout, 'kv_ms_per_transfer'):>26}")
PY

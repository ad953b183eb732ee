#!/usr/bin/env bash
# Week 20: one nanoserve benchmark under several parallel layouts, alternated, each run in its own
# process (medians of separate processes, never the best run), with a time limit that names the run
# that hung.
#
#   scripts/bench_parallel.sh OUT_DIR RUNS "LAYOUT" ["LAYOUT" ...] -- nanoserve-args...
#   e.g. scripts/bench_parallel.sh /tmp/thr 3 "" "-tp 2" "-pp 2" -- bench throughput --model /tmp/llama8b --no-hf
#        scripts/bench_parallel.sh /tmp/lat 3 "" "-tp 2" "-tp 2 --all-reduce nccl" -- bench latency --model /tmp/llama8b --no-hf --no-baseline
#
# A layout is extra options ("" is one GPU). Results: OUT_DIR/<i>-<layout>/<bench>.json, written by the
# benchmark itself, and OUT_DIR/log.txt with every run's output; at the end, each layout's
# headline figure per run (tok/s of `bench latency`, output tok/s of `bench throughput`).
set -uo pipefail
out=$1; runs=$2; shift 2
layouts=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do layouts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
limit=${BENCH_TIMEOUT:-400}
for i in $(seq 1 "$runs"); do
    for layout in "${layouts[@]}"; do
        name="$i-$(echo "${layout:-one-gpu}" | tr -c 'A-Za-z0-9\n' '_')"
        echo "== run $i, layout '${layout:-one GPU}': nanoserve $* $layout" | tee -a "$out/log.txt"
        # shellcheck disable=SC2086  # a layout is several words on purpose
        timeout "$limit" python3 -m nanoserve.cli "$@" $layout --out "$out/$name" >> "$out/log.txt" 2>&1
        code=$?
        [ "$code" -eq 124 ] && echo "!! run $i, layout '${layout}' hung (killed after $limit s)" | tee -a "$out/log.txt"
        [ "$code" -ne 0 ] && [ "$code" -ne 124 ] && echo "!! run $i, layout '${layout}' failed (exit $code)" | tee -a "$out/log.txt"
    done
done
python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
rows = {}
for path in sorted(Path(sys.argv[1]).glob("*/*.json")):
    layout = path.parent.name.split("-", 1)[1]
    data = json.loads(path.read_text())
    first = data.get("rows", [{}])[0]
    figure = first.get("tok_s") or first.get("output_tok_s")
    if figure is not None:
        rows.setdefault(layout, []).append(round(figure, 1))
for layout, figures in rows.items():
    figures.sort()
    print(f"{layout}: {figures} -> median {figures[len(figures) // 2]}")
EOF

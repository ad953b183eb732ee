#!/usr/bin/env bash
# The same benchmark on two source trees, alternated, each run in its own process: for checking
# that a change which should not move a figure (a refactor) did not.
#
#   scripts/bench_two_trees.sh BEFORE_DIR AFTER_DIR OUT_DIR RUNS -- nanoserve-args...
#   e.g. scripts/bench_two_trees.sh before . /tmp/ab 3 -- bench latency --model /tmp/llama1b --no-hf --no-baseline --runs 6
#
# Each tree is put first on PYTHONPATH for its runs (the trees need not be installed). Results:
# OUT_DIR/<before|after>-<i>/<bench>.json, written by the benchmark itself; a timeout of 300 s
# per process names the run that hung.
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); out=$3; runs=$4
shift 4
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
    for side in before after; do
        tree=$before; [ "$side" = after ] && tree=$after
        echo "== $side, run $i: nanoserve $*"
        if ! PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 -m nanoserve.cli "$@" --out "$out/$side-$i"; then
            echo "!! $side run $i failed or hung (300 s)" >&2
        fi
    done
done

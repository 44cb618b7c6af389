#!/usr/bin/env bash
# Where netchannel's time goes with 16 application threads per side (the core-scaling rows
# that fall behind Linux): for each workload, a flat system-wide `perf record -e cpu-clock`
# and a sample of every thread's state (thread-states.py), both taken mid-run.
# Usage: scaling-profile.sh NCPERF PERF OUTDIR [THREADS]
set -u
ncperf=${1:?ncperf}; perf=${2:?perf}; out=${3:?outdir}; n=${4:-16}
here=$(dirname "$(readlink -f "$0")")
mkdir -p "$out"
hosts=netns
"$ncperf" testbed up >/dev/null 2>&1 || hosts=loopback
profile() { # name, then ncperf run arguments
    local name=$1; shift
    "$ncperf" run --stack netchannel --hosts "$hosts" --pattern one-to-one --flows "$n" --max-apps "$n" \
        --duration 4 --warmup 1 --json "$@" >"$out/$name.json" 2>"$out/$name.err" &
    local run=$!
    sleep 2.5
    "$perf" record -e cpu-clock -F 499 -a -o "$out/$name.perf.data" -- sleep 2 2>>"$out/$name.err" &
    local rec=$!
    python3 "$here/thread-states.py" 2 0.01 >"$out/$name.threads.txt"
    wait "$rec"; wait "$run"
    "$perf" report -i "$out/$name.perf.data" --no-children --sort comm,dso,sym --stdio 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -70 >"$out/$name.report.txt"
    "$perf" report -i "$out/$name.perf.data" --no-children --sort sym --stdio 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -40 >"$out/$name.syms.txt"
    echo "== $name"; head -25 "$out/$name.syms.txt"; cat "$out/$name.threads.txt"
}
profile stream64 --workload stream --size 64
profile rr4k --workload rr --size 4096
profile stream1m --workload stream --size 1048576

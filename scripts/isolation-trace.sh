#!/usr/bin/env bash
# Where an L-app's tail latency comes from: runs `ncperf run` of 1 L-app beside 8 T-apps between
# the namespaces and records scheduler and softirq tracepoints for 3 s of its window, then
# prints (scripts/sched-trace.py) the wake-up latency of each thread, the softirq durations and
# what ran while the L threads waited for a CPU.
#   scripts/isolation-trace.sh linux|netchannel OUT_PREFIX [extra ncperf run args]
# Needs root (tracepoints) and a release build (cargo build --release -p ncperf).
set -euo pipefail
cd "$(dirname "$0")/.."
stack=$1 out=$2
shift 2
./target/release/ncperf run --stack "$stack" --workload mixed --latency-flows 1 \
    --throughput-flows 8 --size 65536 --duration 8 --json "$@" > "$out.json" &
run=$!
sleep 4 # set-up and warm-up: trace inside the measured window
perf record -q -e sched:sched_switch -e sched:sched_wakeup -e irq:softirq_entry \
    -e irq:softirq_exit -a -o "$out.data" -- sleep 3 2> /dev/null
wait "$run"
python3 scripts/sched-trace.py "$out.data" ncperf-lat-app,ncperf-rx0

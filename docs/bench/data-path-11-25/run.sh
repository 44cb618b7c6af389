#!/usr/bin/env bash
# Issue 18's rows on the build after the send path's allocations went (the rows of
# ../data-path-11-24/run.sh, and the isolation mix with T alone); JSON here.
set -euo pipefail
here="$(dirname "$0")"
"$here/../data-path-11-24/run.sh" docs/bench/data-path-11-25
cd "$here/../../.."
N=./target/release/ncperf
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"docs/bench/data-path-11-25/$name.json"; }
run mixed-1-8 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536
run t-alone-8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536

#!/usr/bin/env bash
# Issue 18's many-flow rows and the single-flow latency rows, each one interleaved
# `ncperf compare --repetitions 3 --duration 3 --json` between the namespaces; JSON here, or in
# the directory given (relative to the repository root).
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=${NCPERF:-./target/release/ncperf}
out=${1:-docs/bench/data-path-11-24}
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"$out/$name.json"; }
run rr-4k --workload rr --size 4096
run rr-4k-1000 --workload rr --size 4096 --pattern one-to-one --flows 1000
run flows-10k-4k --workload stream --pattern one-to-one --flows 10000 --size 4096
run incast-64 --workload stream --pattern incast --flows 64
run all-to-all-64 --workload stream --pattern all-to-all --flows 64

#!/usr/bin/env bash
# Issue 18's many-flow rows of 64 KiB writes against Linux in one `ncperf compare` each, on the
# build with the pool's two buffer sizes; JSON here.
set -euo pipefail
here="$(dirname "$0")"
cd "$here/../../.."
N=./target/release/ncperf
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"docs/bench/pool-classes/$name.json"; }
run incast-64 --workload stream --pattern incast --flows 64
run all-to-all-64 --workload stream --pattern all-to-all --flows 64
run t-alone-8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536
run mixed-1-8 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536

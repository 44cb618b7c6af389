#!/usr/bin/env bash
# Issue 18's rows and the isolation mix again, on the build whose streams keep to home
# channels (the commands of ../data-path-11-25/run.sh); JSON here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/bench/data-path-11-25-homes
"docs/bench/data-path-11-24/run.sh" "$out"
N=./target/release/ncperf
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"$out/$name.json"; }
run mixed-1-8 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536
run t-alone-8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536

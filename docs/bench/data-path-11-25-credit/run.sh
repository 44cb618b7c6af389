#!/usr/bin/env bash
# Issue 18's rows and the isolation mix again, on the build whose CREDITs ride with the next
# frames out (the commands of ../data-path-11-25/run.sh); JSON here, or in the directory given
# (relative to the repository root).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-docs/bench/data-path-11-25-credit}
"docs/bench/data-path-11-24/run.sh" "$out"
N=${NCPERF:-./target/release/ncperf}
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"$out/$name.json"; }
run mixed-1-8 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536
run t-alone-8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536

#!/usr/bin/env bash
# Issue 18's isolation rows (1 L beside 8 T, and the 8 T alone) against Linux in one
# `ncperf compare` each, on the build with the per-class flush; JSON here.
set -euo pipefail
here="$(dirname "$0")"
cd "$here/../../.."
N=./target/release/ncperf
run() { local name=$1; shift; $N compare --repetitions 3 --duration 3 --json "$@" >"docs/bench/class-flush/$name.json"; }
run mixed-1-8 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536
run t-alone-8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536
# The L flow open-loop at 6,000 requests/s, about Linux's closed-loop rate in the mix, so that
# both stacks' T-apps share the cores with the same L load.
run mixed-1-8-rate6000 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536 --rate 6000

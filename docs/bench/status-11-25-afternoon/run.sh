#!/usr/bin/env bash
# Where issue 17's and 18's targets stand on one build, in one sitting: issue 18's rows and the
# isolation mix (the commands of ../data-path-11-25-credit/run.sh), the one-stream sweep from
# 64 B to 1 MiB (../stall/run.sh, tag 11-25-midday), and every program of `ncperf programs`
# (3 interleaved repetitions). JSON here; `summary.py` prints the table of BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/bench/status-11-25-afternoon
docs/bench/data-path-11-25-credit/run.sh "$out"
docs/bench/stall/run.sh 11-25-afternoon
./target/release/ncperf programs --repetitions 3 --json "$out/programs.json" >"$out/programs.txt" 2>&1

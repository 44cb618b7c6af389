#!/usr/bin/env bash
# Where issue 17's and 18's targets stand on one build, in one sitting: issue 18's rows and the
# isolation mix (the commands of ../data-path-11-25-credit/run.sh), the one-stream sweep from
# 64 B to 1 MiB (../stall/run.sh, tag TAG), and every program of `ncperf programs`
# (3 interleaved repetitions). Usage: run.sh [OUT [TAG]] (default: this directory and
# 11-25-midday; OUT relative to the repository root). `summary.py OUT TAG` prints the tables of
# BENCHMARKS.md. NCPERF=PATH runs another build's ncperf (and the launcher beside it), e.g. the
# profile-guided one of scripts/pgo.sh: NCPERF=target/pgo/release/ncperf.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-docs/bench/status-11-25}
tag=${2:-11-25-midday}
mkdir -p "$out"
docs/bench/data-path-11-25-credit/run.sh "$out"
docs/bench/stall/run.sh "$tag"
"${NCPERF:-./target/release/ncperf}" programs --repetitions 3 --json "$out/programs.json" >"$out/programs.txt" 2>&1

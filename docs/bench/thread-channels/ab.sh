#!/usr/bin/env bash
# Channels per thread: issue 18's rows, the isolation mix and the one-stream sizes on two ncperf
# builds, interleaved (../ncperf-ab.sh), into OUT (default: ab/ beside this script).
# Usage: ab.sh OLD_NCPERF NEW_NCPERF [ROUNDS [OUT]]; summary: ../ab-summary.py OUT KEYS...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
old=$1 new=$2 rounds=${3:-3} out=${4:-$here/ab}
"$here/../ncperf-ab.sh" "$old" "$new" "$rounds" "$out" \
  't8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536' \
  'mixed --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536' \
  'single1m --workload stream --size 1048576' \
  'single64k --workload stream --size 65536' \
  'single4k --workload stream --size 4096' \
  'flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096' \
  'a2a --workload stream --pattern all-to-all --flows 64' \
  'incast --workload stream --pattern incast --flows 64' \
  'rr1000 --workload rr --size 4096 --pattern one-to-one --flows 1000' \
  'rr --workload rr --size 4096'

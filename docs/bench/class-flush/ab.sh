#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds for the per-class flush: a thread flushes only the classes
# it deferred sends in. The isolation mix (1 L beside 8 T) is the row it is for; the others are
# rows it must not move (T alone, one RPC flow, 1,000 RPC flows, one 1 MiB stream).
# Usage: ab.sh OLD_NCPERF NEW_NCPERF OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
set -euo pipefail
here=$(dirname "$0")
"$here/../ncperf-ab.sh" "$1" "$2" 8 "$3" \
  "mixed18 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536"
"$here/../ncperf-ab.sh" "$1" "$2" 3 "$3" \
  "t8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536" \
  "rr1 --workload rr --size 4096" \
  "rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096" \
  "stream1m --workload stream --size 1048576"

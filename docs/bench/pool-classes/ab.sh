#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds for the pool's two buffer sizes (a write's end that does not
# fill a 256 KiB buffer takes a 64 KiB one): rows of 64 KiB writes over many flows, one 64 KiB
# and one 1 MiB stream, 10,000 flows of 4 KiB.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "a2a64 --workload stream --pattern all-to-all --flows 64" \
  "incast64 --workload stream --pattern incast --flows 64" \
  "t8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536" \
  "stream64k --workload stream --size 65536" \
  "stream1m --workload stream --size 1048576" \
  "flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096"

#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on the rows a CREDIT's timing can move: RPCs over 1, 100
# and 1,000 flows, 10,000 flows of 4 KiB writes, one 4 KiB and one 1 MiB stream, incast 64.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "rr1 --workload rr --size 4096" \
  "rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096" \
  "flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096" \
  "stream4k --workload stream --size 4096" \
  "stream1m --workload stream --size 1048576" \
  "incast64 --workload stream --pattern incast --flows 64" \
  "rr100 --workload rr --pattern one-to-one --flows 100 --size 4096"

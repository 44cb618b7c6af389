#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on the rows a stream's home channel can move: RPCs over
# 1 and 1,000 flows, 10,000 flows of 4 KiB writes, one 4 KiB and one 1 MiB stream, incast and
# all-to-all 64, and 8 throughput flows alone and beside a latency flow.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "rr1 --workload rr --size 4096" \
  "rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096" \
  "flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096" \
  "stream4k --workload stream --size 4096" \
  "stream1m --workload stream --size 1048576" \
  "incast64 --workload stream --pattern incast --flows 64" \
  "a2a64 --workload stream --pattern all-to-all --flows 64" \
  "t8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536" \
  "mixed18 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536"

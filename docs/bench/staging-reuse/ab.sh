#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on bulk rows where readers lag their channels (staged
# payloads): 8 T-apps of 64 KiB writes, incast over 64 flows, and one stream of 64 KiB writes.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "t8 --workload mixed --latency-flows 0 --throughput-flows 8 --size 65536" \
  "incast64 --workload stream --pattern incast --flows 64" \
  "stream64k --workload stream --size 65536"

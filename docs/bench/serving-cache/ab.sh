#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds for two costs per send taken out: the serving channels
# kept per class instead of collected per call, and a channel write of a few frames filling 16
# empty slices instead of 512. Rows that send often: 1,000-flow RPC, 10,000 flows of 4 KiB,
# one 4 KiB stream, one 4 KiB RPC flow.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096" \
  "flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096" \
  "stream4k --workload stream --size 4096" \
  "rr1 --workload rr --size 4096"

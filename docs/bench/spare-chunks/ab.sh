#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on the rows where every write starts a send-buffer
# chunk: 10,000 flows of 4 KiB writes, 4 KiB RPCs over 1,000 flows, and one stream of 4 KiB
# writes.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096" \
  "rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096" \
  "stream4k --workload stream --size 4096"

#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds: resident memory per peer of a server with 100 peers of
# 4 KiB RPCs, and the rows a read buffer's reuse could move (one and 1,000 RPC flows, one 1 MiB
# stream, incast over 64 flows).
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
exec "$(dirname "$0")/../ncperf-ab.sh" "$@" \
  "peers100 --workload rr --size 4096 --pattern one-to-one --flows 100 --peers 100 --rate 200" \
  "rr1 --workload rr --size 4096" \
  "rr1000 --workload rr --size 4096 --pattern one-to-one --flows 1000" \
  "stream1m --workload stream --size 1048576" \
  "incast64 --workload stream --pattern incast --flows 64"

#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds: resident memory per peer of a server with 100 peers of
# 4 KiB RPCs, and the rows a read buffer's reuse could move (one and 1,000 RPC flows, one 1 MiB
# stream, incast over 64 flows).
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
set -euo pipefail
old=$1 new=$2 rounds=$3 out=$4
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for pair in "new $new" "old $old"; do
    set -- $pair
    tag=$1 bin=$2
    run() { local row=$1; shift; "$bin" run --stack netchannel --duration 3 --json "$@" >"$out/$row-$tag-$round.json"; }
    run peers100 --workload rr --size 4096 --pattern one-to-one --flows 100 --peers 100 --rate 200
    run rr1 --workload rr --size 4096
    run rr1000 --workload rr --size 4096 --pattern one-to-one --flows 1000
    run stream1m --workload stream --size 1048576
    run incast64 --workload stream --pattern incast --flows 64
  done
done

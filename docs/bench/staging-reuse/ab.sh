#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on bulk rows where readers lag their channels (staged
# payloads): 8 T-apps of 64 KiB writes, incast over 64 flows, and one stream of 64 KiB writes.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
set -euo pipefail
old=$1 new=$2 rounds=$3 out=$4
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for pair in "new $new" "old $old"; do
    set -- $pair
    tag=$1 bin=$2
    "$bin" run --stack netchannel --duration 3 --json --workload mixed --latency-flows 0 \
      --throughput-flows 8 --size 65536 >"$out/t8-$tag-$round.json"
    "$bin" run --stack netchannel --duration 3 --json --workload stream --pattern incast \
      --flows 64 >"$out/incast64-$tag-$round.json"
    "$bin" run --stack netchannel --duration 3 --json --workload stream --size 65536 \
      >"$out/stream64k-$tag-$round.json"
  done
done

#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds on the rows where every write starts a send-buffer
# chunk: 10,000 flows of 4 KiB writes, 4 KiB RPCs over 1,000 flows, and one stream of 4 KiB
# writes.
# Usage: ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUTDIR (then: docs/bench/ab-summary.py OUTDIR KEYS...)
set -euo pipefail
old=$1 new=$2 rounds=$3 out=$4
mkdir -p "$out"
run() { # build tag row args...
  local bin=$1 tag=$2 row=$3; shift 3
  "$bin" run --stack netchannel --duration 3 --json "$@" >"$out/$row-$tag-$round.json"
}
for round in $(seq 1 "$rounds"); do
  for pair in "new $new" "old $old"; do
    set -- $pair
    run "$2" "$1" flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096
    run "$2" "$1" rr1000 --workload rr --pattern one-to-one --flows 1000 --size 4096
    run "$2" "$1" stream4k --workload stream --size 4096
  done
done

#!/usr/bin/env bash
# Interleaved A/B of two builds of the interposition library (`netchannel` launcher and
# libnetchannel_preload.so side by side in each directory) under `ncperf programs`, one
# repetition per build per round, old first.
# Usage: docs/bench/programs-ab.sh OLD_DIR NEW_DIR ROUNDS OUT_DIR PROGRAMS SCALE [PREFIX]
# Writes OUT_DIR/PREFIX{old,new}-ROUND.{json,txt}.
set -euo pipefail
cd "$(dirname "$0")/../.."
old=$1 new=$2 rounds=$3 out=$4 only=$5 scale=$6 prefix=${7:-}
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    dir=$old; [ "$v" = new ] && dir=$new
    ./target/release/ncperf programs --netchannel "$dir/netchannel" --only "$only" \
      --repetitions 1 --scale "$scale" \
      --json "$out/$prefix$v-$r.json" >"$out/$prefix$v-$r.txt" 2>&1
  done
done

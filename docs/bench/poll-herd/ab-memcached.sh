#!/usr/bin/env bash
# memcached alone (set and get, with the get figure parsed right: commit 6db8e02), interleaved
# between two builds of the interposition library. Usage: ab-memcached.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
cd "$(dirname "$0")/../../.."
old=$1 new=$2 rounds=${3:-3}
out=docs/bench/poll-herd
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    dir=$old; [ "$v" = new ] && dir=$new
    ./target/release/ncperf programs --netchannel "$dir/netchannel" --only memcached \
      --repetitions 1 --scale 1 --json "$out/memcached-$v-$r.json" >"$out/memcached-$v-$r.txt" 2>&1
  done
done

#!/usr/bin/env bash
# Interleaved A/B of two builds of the interposition library (`netchannel` launcher and
# libnetchannel_preload.so side by side in each directory): before and after poll/select over
# carried fds sleep in the thread's own epoll set (the programs that wait in poll or select).
# Usage: docs/bench/poll-herd/ab.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
cd "$(dirname "$0")/../../.."
old=$1 new=$2 rounds=${3:-3}
out=docs/bench/poll-herd
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    dir=$old; [ "$v" = new ] && dir=$new
    ./target/release/ncperf programs --netchannel "$dir/netchannel" \
      --only memcached,iperf3,sockperf --repetitions 1 --scale 1 \
      --json "$out/$v-$r.json" >"$out/$v-$r.txt" 2>&1
  done
done

#!/usr/bin/env bash
# ncperf programs with the default session shards (2 on this 2-core machine) against one
# session per peer (NETCHANNEL_SESSION_SHARDS=1, which netchannel run's library reads),
# interleaved: ROUNDS rounds of each. Usage: run.sh [ROUNDS]
set -u
cd "$(dirname "$0")/../../../.."
out=docs/bench/scaling-2026-11-27/programs
for round in $(seq "${1:-2}"); do
  for v in default s1; do
    if [ $v = s1 ]; then export NETCHANNEL_SESSION_SHARDS=1; else unset NETCHANNEL_SESSION_SHARDS; fi
    ./target/release/ncperf programs --only memcached,iperf3,nginx,pgbench --repetitions 1 \
      --json "$out/$v-$round.json" >"$out/$v-$round.txt" 2>&1
  done
done

#!/usr/bin/env bash
# The session of 2026-11-27 (from 18:05): what a fork and an exit cost on the testbed
# (`ncperf testbed up`), kernel TCP and then carried. Wall-clock figures of one machine, quoted
# in docs/ARCHITECTURE.md ("Processes"), not ratios of the data path.
#   fork: a server holding N carried connections forks, the child _exits, the parent waits
#         (median of 20): forkcost.py PORT N, with opener.py PORT N SECONDS as the clients.
#   exit: a client writes 3 MB, closes, exits at once while the server sleeps 0.5 s before
#         reading: cli2.py BYTES close, against srv2.py 0.5 (which prints what it read).
# usage: docs/bench/processes-11-27/run.sh [path/to/netchannel]
set -euo pipefail
cd "$(dirname "$0")"
nc=${1:-../../../target/release/netchannel}
for pre in "" "$nc run --"; do
  for n in 10 2000; do
    port=$((6900 + RANDOM % 90))
    ip netns exec ncperf-b $pre python3 forkcost.py "$port" "$n" > /tmp/forkcost.out 2>&1 &
    sleep 0.6
    ip netns exec ncperf-a $pre python3 opener.py "$port" "$n" 3
    wait
    echo "${pre:+carried: }$(cat /tmp/forkcost.out)"
  done
  ip netns exec ncperf-b $pre python3 srv2.py 0.5 > /tmp/srv2.out 2>&1 &
  sleep 0.4
  /usr/bin/time -f "${pre:+carried: }client exit after 3 MB: %e s" \
    ip netns exec ncperf-a $pre python3 cli2.py 3000000 close
  sleep 1.5
  pkill -f srv2.py || true
  echo "${pre:+carried: }server: $(cat /tmp/srv2.out)"
done

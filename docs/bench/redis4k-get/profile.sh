#!/usr/bin/env bash
# A system-wide CPU profile (perf, cpu-clock) of 4 s of redis4k GET between the namespaces, per
# stack: shares by comm,dso and the top symbols. Usage: profile.sh [NETCHANNEL] OUT_DIR
set -uo pipefail
nc=$(realpath "${1:-target/release/netchannel}"); out=${2:-docs/bench/redis4k-get}
. "$(dirname "$0")/common.sh"
port=6460
for stack in linux netchannel; do
  pre=""; [ "$stack" = netchannel ] && pre="$nc run --"
  port=$((port + 1))
  start_server_with_key "$pre" $port
  ip netns exec ncperf-a $pre redis-benchmark -h 10.214.0.2 -p $port -c 50 -P 16 -t get \
    -n 3000000 -d 4096 -q >/dev/null 2>&1 &
  cpid=$!
  sleep 2
  perf record -q -e cpu-clock -a -o /tmp/r4k-$stack.data -- sleep 4 2>/dev/null
  kill $cpid; wait $cpid 2>/dev/null; kill $spid; wait $spid 2>/dev/null
  perf report -i /tmp/r4k-$stack.data --stdio --sort comm,dso 2>/dev/null | grep -v "^#" | grep -v "^$" | head -16 >"$out/profile-$stack-comm-dso.txt"
  perf report -i /tmp/r4k-$stack.data --stdio --sort sym 2>/dev/null | grep -v "^#" | grep -v "^$" | head -30 >"$out/profile-$stack-sym.txt"
  sleep 1
done

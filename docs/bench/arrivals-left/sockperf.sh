#!/usr/bin/env bash
# sockperf ping-pong (64 B, SECS seconds) between the ncperf namespaces, on kernel TCP (`linux`)
# or with both sides under DIR's `netchannel run`; prints p50, p99, round trips, and the whole
# machine's system calls and context switches per round trip (perf stat -a).
# Usage: docs/bench/arrivals-left/sockperf.sh linux|DIR [SECS]
set -uo pipefail
mode=$1; secs=${2:-5}
if [ "$mode" = linux ]; then W=(); else W=("$mode/netchannel" run --); fi
tmp=$(mktemp -d)
ip netns exec ncperf-b "${W[@]}" sockperf server --tcp -i 10.214.0.2 -p 11111 >/dev/null 2>&1 &
sleep 1.5
ip netns exec ncperf-a perf stat -e raw_syscalls:sys_enter,context-switches -a -o "$tmp/stat" -- \
  "${W[@]}" sockperf ping-pong --tcp -i 10.214.0.2 -p 11111 -m 64 -t "$secs" >"$tmp/out" 2>&1
pkill -f "sockperf server"; sleep 0.5
rt=$(grep -o 'ReceivedMessages=[0-9]*' "$tmp/out" | head -1 | cut -d= -f2)
p50=$(grep 'percentile 50.000' "$tmp/out" | awk '{print $NF}')
p99=$(grep 'percentile 99.000' "$tmp/out" | awk '{print $NF}')
sc=$(grep raw_syscalls "$tmp/stat" | awk '{gsub(",","",$1); print $1}')
cs=$(grep context-switches "$tmp/stat" | awk '{gsub(",","",$1); print $1}')
echo "$mode p50 $p50 p99 $p99 rt $rt syscalls/rt $(python3 -c "print(round($sc/$rt,2))") cs/rt $(python3 -c "print(round($cs/$rt,2))")"
rm -rf "$tmp"

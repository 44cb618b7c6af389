#!/usr/bin/env bash
# System calls per thread (perf trace -s, 2 s of the whole machine) during a sockperf ping-pong
# (64 B) with both sides under DIR's `netchannel run`: the program's threads and the engines'
# workers (reads of channels, eventfd writes that wake a program thread).
# Usage: docs/bench/arrivals-left/trace.sh DIR OUT   (OUT: perf trace's summary)
set -uo pipefail
W=("$1/netchannel" run --); out=$2
ip netns exec ncperf-b "${W[@]}" sockperf server --tcp -i 10.214.0.2 -p 11111 >/dev/null 2>&1 &
sleep 1.5
ip netns exec ncperf-a "${W[@]}" sockperf ping-pong --tcp -i 10.214.0.2 -p 11111 -m 64 -t 5 >/dev/null 2>&1 &
sleep 1.5
timeout 10 perf trace -s -a -- sleep 2 2>"$out" >/dev/null
wait %2 2>/dev/null; pkill -f "sockperf server"; sleep 0.5
grep -E "events|^ +[a-z_0-9]+ +[0-9]+" "$out" | grep -E -A8 "^ (sockperf|nc-worker)" \
  | grep -E "events|epoll|read|write|sendmsg|fcntl" | awk '{print $1,$2,$3}'

#!/bin/bash
# churn-syscalls.sh 0|1: 5,000 sequential short connections (one client thread) to the one-process
# Python echo server, on kernel TCP (0) or both ends under netchannel run (1), with the system
# calls and context switches per connection of the server process and of the client (perf stat).
NC=${NC:-$(dirname "$0")/../../../target/release/netchannel}
wrap=$1
sw=(); cw=(); [[ $wrap == 1 ]] && sw=($NC run --port 7400 --) && cw=($NC run --port 7400 --)
ip netns exec ncperf-b "${sw[@]}" python3 $(dirname "$0")/select_echo.py 10.214.0.2 7401 &
sleep 1.5
spid=$(pgrep -f "python3 $(dirname "$0")/select_echo.py" | tail -1)
perf stat -e raw_syscalls:sys_enter,context-switches -p $spid -o /tmp/s.txt &
pp=$!
sleep 0.3
perf stat -e raw_syscalls:sys_enter,context-switches -o /tmp/c.txt -- ip netns exec ncperf-a "${cw[@]}" python3 $(dirname "$0")/churn_client.py 10.214.0.2 7401 5000 1 | tail -1
kill -INT $pp; sleep 0.5; pkill -TERM -f "python3 $(dirname "$0")/select_echo.py"; wait 2>/dev/null
for f in s c; do echo "== $f"; grep -E '^ +[0-9,]+ ' /tmp/$f.txt | awk '{gsub(",","",$1); printf "%-36s %6.2f per conn\n", $2, $1/5000}'; done

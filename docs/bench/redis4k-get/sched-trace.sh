#!/usr/bin/env bash
# Usage: sched-trace.sh DIR|linux OUT.data: redis-server in ncperf-b, redis-benchmark 4 KiB GETs (-c 50 -P 16)
# from ncperf-a, both under `netchannel run` from DIR (or kernel TCP), with sched_switch/wakeup and
# hrtimer events of the whole machine recorded over the GET phase. Then
# `perf script -i OUT.data > OUT.txt; python3 thread-busy.py OUT.txt` gives each thread's busy time.
# like redis-get.sh but perf records the GET phase system-wide
set -euo pipefail
dir=$1; out=$2
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6399 --bind 10.214.0.2 --protected-mode no \
  --save "" --appendonly no --daemonize no >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do ip netns exec ncperf-b ss -ltn | grep -q ':6399 ' && break; sleep 0.1; done
sleep 0.5
bench() { ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 "$@" -d 4096 --csv | tail -1; }
bench -t set -n 100000 >/dev/null
perf record -e sched:sched_switch,sched:sched_wakeup,timer:hrtimer_expire_entry -a -o $out -- bash -c "$(declare -f bench); wrap=(${wrap[*]}); bench -t get -n 400000" 2>/dev/null

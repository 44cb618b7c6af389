#!/usr/bin/env bash
# redis4k GET between the namespaces (DIR's `netchannel run`, or `linux`) under
# `perf record -e sched:sched_switch -g -a` into OUT. Usage: sched-switches.sh DIR|linux OUT
dir=$1; out=$2
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6399 --bind 10.214.0.2 --save '' --protected-mode no >/dev/null 2>&1 & s=$!
sleep 1
ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 -t set -n 100000 -d 4096 -q -r 1000 >/dev/null 2>&1
perf record -e sched:sched_switch -g -a -o $out -- ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 -t get -n 400000 -d 4096 -r 1000 --csv 2>/dev/null | tail -1
kill $s; wait $s 2>/dev/null

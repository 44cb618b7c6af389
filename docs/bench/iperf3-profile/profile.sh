#!/usr/bin/env bash
# Usage: profile.sh DIR|linux OUT.data (DIR holds the netchannel launcher; the testbed must be up: ncperf testbed up)
# profile iperf3 -P 8 between the namespaces; DIR = netchannel build dir or linux
set -euo pipefail
dir=$1; out=$2
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" iperf3 -s -p 5299 -B 10.214.0.2 -1 >/dev/null 2>&1 &
srv=$!
sleep 1
perf record -a -g -e cpu-clock -F 2999 -o $out -- ip netns exec ncperf-a "${wrap[@]}" iperf3 -c 10.214.0.2 -p 5299 -P 8 -t 4 -J 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print('Gbit/s', round(d['end']['sum_received']['bits_per_second']/1e9,2))"
wait $srv 2>/dev/null || true

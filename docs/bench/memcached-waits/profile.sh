#!/usr/bin/env bash
# memcached -t 4 and memcslap --concurrency=16 (320,000 sets) between the ncperf namespaces, both
# on kernel TCP (linux) or under DIR/netchannel run; perf record -a -g for 2 s of the run into
# OUT.data. Per-key figures: samples / 999 / (keys set in those 2 s). Usage: profile.sh linux|DIR OUT
set -euo pipefail
dir=$1; out=$2
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
sleep 1
(ip netns exec ncperf-a "${wrap[@]}" memcslap --servers=10.214.0.2:6392 --concurrency=16 --execute-number=20000 --test=set | grep "to set") &
sleep 0.5
perf record -a -g -e cpu-clock -F 999 -o "$out.data" -- sleep 2 >/dev/null 2>&1
wait %2 2>/dev/null || sleep 3

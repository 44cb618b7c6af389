#!/usr/bin/env bash
# User and system CPU of each side over 160,000 memcslap sets (16 threads) against memcached -t 4
# between the ncperf namespaces: the client's from time(1), the server's (all its threads, the
# engine's included) from /proc/PID/stat. Usage: cpu.sh linux|DIR
dir=$1
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root & server=$!
sleep 1
pid=$(pgrep -x memcached)
s0=$(awk '{print $14, $15}' /proc/$pid/stat)
/usr/bin/time -f "client user %U sys %S wall %e" ip netns exec ncperf-a "${wrap[@]}" memcslap \
  --servers=10.214.0.2:6392 --concurrency=16 --execute-number=10000 --test=set 2>&1 |
  grep -E "client|to set"
s1=$(awk '{print $14, $15}' /proc/$pid/stat)
echo "$s0 $s1" | awk '{printf "server user %.2f sys %.2f\n", ($3-$1)/100, ($4-$2)/100}'
kill $server; wait $server 2>/dev/null

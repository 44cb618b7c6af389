#!/usr/bin/env bash
# memcslap set (CONC threads, 32,000 keys) against memcached -t 4 between the ncperf namespaces, both
# under DIR's `netchannel run` (or kernel TCP with `linux`), the client under callgrind with a
# simulated cache (32 KiB 8-way L1, 512 KiB 8-way last level, as one Zen 3 core's L1 and L2).
# Usage: run.sh DIR|linux OUT [CONC]; then by.py OUT 32000 obj|fn SORT-EVENT ROWS
dir=$1; out=$2; conc=${3:-16}
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root & srv=$!; sleep 1
n=$((32000/conc))
timeout 600 ip netns exec ncperf-a "${wrap[@]}" valgrind --tool=callgrind --cache-sim=yes --D1=32768,8,64 --LL=524288,8,64 --callgrind-out-file=$out memcslap --servers=10.214.0.2:6392 --concurrency=$conc --execute-number=$n --test=set 2>&1 | grep -E "to set"
kill $srv; wait $srv 2>/dev/null

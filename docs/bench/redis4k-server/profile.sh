#!/usr/bin/env bash
# The redis-server thread's (or, with `client`, redis-benchmark's) own time during
# redis-benchmark's 4 KiB GETs (-c 50 -P 16), with user and kernel call stacks (perf
# --call-graph dwarf, 0.6 s of the thread at 999 Hz), on kernel TCP (`linux`) or under
# `netchannel run` (DIR holds the launcher).
# Usage: profile.sh linux|DIR OUT [server|client]   (writes OUT.data, OUT.txt, OUT.rate)
# Then: buckets.py [--client] OUT.txt OUT.rate [...] prints where
# the thread's time went per 1,000 GETs.
set -euo pipefail
dir=$1; out=$2; side=${3:-server}
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
pkill redis-server || true; sleep 0.5
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6390 --bind 10.214.0.2 --protected-mode no \
  --save "" --appendonly no >/dev/null 2>&1 &
sleep 1
# One 4 KiB value under the key the GETs read.
ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6390 -c 50 -P 16 -t set \
  -n 100000 -d 4096 -q >/dev/null 2>&1 || true
(ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6390 -c 50 -P 16 -t get \
  -n 800000 -d 4096 -q 2>&1 | tr '\r' '\n' | grep -a "GET:" | tail -1 >"$out.rate") &
sleep 0.5
perf record -F 999 -e cpu-clock --call-graph dwarf,16384 -o "$out.data" \
  -p "$(if [[ $side == client ]]; then pgrep -x redis-benchmark; else pgrep -f 'redis-server 10.214'; fi | head -1)" \
  -- sleep 0.6 >/dev/null 2>&1
sleep 3
pkill redis-server || true
perf script -i "$out.data" >"$out.txt" 2>/dev/null
cat "$out.rate"

#!/usr/bin/env bash
# Usage: get-with-env.sh VAR=VALUE...: the GET phase (400,000 GETs) with VAR=VALUE in both programs' environment
# (e.g. NETCHANNEL_CHANNELS=2); prints the GET requests/s. Run from the repository root.
# redis GET phase with env passed to both sides; prints GET rps
set -euo pipefail
dir=target/release; envs=("$@")
ip netns exec ncperf-b env "${envs[@]}" $dir/netchannel run -- redis-server --port 6399 --bind 10.214.0.2 --protected-mode no --save "" --appendonly no --daemonize no >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do ip netns exec ncperf-b ss -ltn | grep -q ':6399 ' && break; sleep 0.1; done
sleep 0.5
b() { ip netns exec ncperf-a env "${envs[@]}" $dir/netchannel run -- redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 "$@" -d 4096 --csv | tail -1 | cut -d, -f2; }
b -t set -n 100000 >/dev/null
echo "$* GET $(b -t get -n 400000)"

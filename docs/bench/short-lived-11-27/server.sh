#!/usr/bin/env bash
# The server's side of short-lived clients: CPU time of a redis-server (all its threads, from
# /proc/PID/stat) per `redis-cli ping` process, 200 clients, for each build given (the server
# and the clients under the same build) and kernel TCP. Usage: server.sh BUILD_DIR...
# (each a target/release holding netchannel). Needs the testbed and redis.
set -euo pipefail
tick=$(getconf CLK_TCK)
for build in linux "$@"; do
  if [ "$build" = linux ]; then run=(); else run=("$build/netchannel" run --); fi
  ip netns exec ncperf-b "${run[@]}" redis-server --port 9431 --bind 10.214.0.2 --save '' \
    --appendonly no --protected-mode no >/dev/null 2>&1 &
  sleep 1
  pid=$(pgrep -f "redis-server 10.214.0.2:9431")
  cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
  before=$(cpu)
  for i in $(seq 200); do ip netns exec ncperf-a "${run[@]}" redis-cli -h 10.214.0.2 -p 9431 ping >/dev/null; done
  after=$(cpu)
  kill "$pid"; wait 2>/dev/null || true
  echo "$build: server CPU per client, ms: $(python3 -c "print(f'{($after - $before) * 1000 / $tick / 200:.3f}')")"
done

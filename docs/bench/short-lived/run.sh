#!/usr/bin/env bash
# Short-lived client processes under `netchannel run`, one build against another (both ends
# under the same build): redis-cli PING against redis-server, 40 runs; a non-blocking connect to
# an address of the link nobody holds (a "host" whose channel port drops packets), 5 processes
# each to another port;
# a socat client against a socat server that forks per connection, 20 runs, with how the
# clients' connections went. Usage: run.sh BUILD_DIR... (each a target/release holding netchannel); kernel
# TCP is measured first. Needs the testbed (ncperf testbed up), redis, socat.
set -euo pipefail
ms() { python3 -c "import sys; print(f'{(int(sys.argv[2]) - int(sys.argv[1])) / 1e6 / int(sys.argv[3]):.2f}')" "$@"; }
for build in linux "$@"; do
  if [ "$build" = linux ]; then run=(); else run=("$build/netchannel" run --); fi
  ip netns exec ncperf-b "${run[@]}" redis-server --port 9411 --save '' --appendonly no \
    --protected-mode no >/dev/null 2>&1 &
  sleep 1
  t0=$(date +%s%N)
  for i in $(seq 40); do ip netns exec ncperf-a "${run[@]}" redis-cli -h 10.214.0.2 -p 9411 ping >/dev/null; done
  t1=$(date +%s%N)
  echo "$build: redis-cli ping, ms per run: $(ms "$t0" "$t1" 40)"
  kill %1; wait %1 2>/dev/null || true
  waits=""
  for i in $(seq 5); do
    waits+=" $(ip netns exec ncperf-a "${run[@]}" python3 -c "
import socket, time
s = socket.socket(); s.setblocking(False)
t = time.monotonic()
try: s.connect(('10.214.0.99', 5000 + $i))
except BlockingIOError: pass
print(f'{(time.monotonic() - t) * 1000:.0f}')" 2>/dev/null || echo x)"
  done
  echo "$build: non-blocking connect to a silent host, ms per process:$waits"
  stats=$(mktemp)
  if [ "$build" = linux ]; then cli=(); else cli=("$build/netchannel" run --stats-file "$stats" --); fi
  ip netns exec ncperf-b "${run[@]}" socat TCP-LISTEN:9412,fork,reuseaddr EXEC:cat >/dev/null 2>&1 &
  sleep 1
  t0=$(date +%s%N)
  for i in $(seq 20); do echo hello | ip netns exec ncperf-a "${cli[@]}" socat -t 2 - TCP:10.214.0.2:9412 >/dev/null; done
  t1=$(date +%s%N)
  kill -TERM %1; wait %1 2>/dev/null || true
  sum() { (grep -o "$1 [0-9]*" "$stats" 2>/dev/null || true) | awk '{s += $NF} END {print s + 0}'; }
  echo "$build: socat against a forking socat, ms per run: $(ms "$t0" "$t1" 20); client connections carried (relayed at the server) $(sum 'virtual sockets'), over kernel TCP as a forked server's $(sum 'forked server')"
  rm -f "$stats"
done

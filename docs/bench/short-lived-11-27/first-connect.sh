#!/usr/bin/env bash
# How long a fresh process's first connect to a carried server takes (Python's
# `socket.connect`, microseconds: the engine's start, the channel's dial and handshake, the
# open and the placeholder), per interposition library given, and on kernel TCP; 20 processes
# each, medians and range, ROUNDS interleaved rounds. The server runs under the library of the
# launcher beside this checkout's build. Usage: first-connect.sh ROUNDS LIB... Needs the testbed
# and redis.
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=$1; shift
ip netns exec ncperf-b ./target/release/netchannel run -- redis-server --port 9441 \
  --bind 10.214.0.2 --save '' --appendonly no --protected-mode no >/dev/null 2>&1 &
carried=$!
ip netns exec ncperf-b redis-server --port 9442 --bind 10.214.0.2 --save '' --appendonly no \
  --protected-mode no >/dev/null 2>&1 &
kernel=$!
trap 'kill $carried $kernel 2>/dev/null || true' EXIT
sleep 1
probe='import socket, sys, time
s = socket.socket(); t = time.perf_counter(); s.connect(("10.214.0.2", int(sys.argv[1])))
print(int((time.perf_counter() - t) * 1e6))'
summary() { sort -n | awk '{a[NR] = $1} END {print "median", a[int((NR + 1) / 2)], "min", a[1], "max", a[NR]}'; }
for r in $(seq "$rounds"); do
  for lib in "$@"; do
    echo "$lib: $(for i in $(seq 20); do ip netns exec ncperf-a env LD_PRELOAD="$lib" python3 -c "$probe" 9441; done | summary)"
  done
  echo "linux: $(for i in $(seq 20); do ip netns exec ncperf-a python3 -c "$probe" 9442; done | summary)"
done

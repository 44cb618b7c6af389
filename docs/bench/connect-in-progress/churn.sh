#!/usr/bin/env bash
# Connection setup as programs see it, between the ncperf namespaces (`ncperf testbed up`):
# 1. 2,000 concurrent asyncio connects (many.py) to an asyncio echo server (aserv.py, backlog
#    100), each sending and reading back 100 bytes;
# 2. wrk -c 16 with `Connection: close` (one connection per request) against a Node.js HTTP
#    server (4 KiB answers; one process, so carried connections are direct).
# Each on kernel TCP and with both sides under `netchannel run` (the connects twice, interleaved).
# Usage: churn.sh DIR (holds the `netchannel` launcher)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nc=$1/netchannel
trap 'pkill -f aserv.py || true; pkill -f churn-server || true' EXIT
ip netns exec ncperf-b "$nc" run -- python3 "$here/aserv.py" 10.214.0.2 9500 >/dev/null 2>&1 &
ip netns exec ncperf-b python3 "$here/aserv.py" 10.214.0.2 9501 >/dev/null 2>&1 &
js="const h=require('http'),b=Buffer.alloc(4096,'x');h.createServer((q,r)=>r.end(b)).listen(+process.argv[1],'10.214.0.2');"
ip netns exec ncperf-b "$nc" run -- node -e "$js" 8089 churn-server >/dev/null 2>&1 &
ip netns exec ncperf-b node -e "$js" 8091 churn-server >/dev/null 2>&1 &
sleep 2
for round in 1 2; do
  echo "round $round: 2,000 concurrent connects"
  echo -n "  netchannel: "; ip netns exec ncperf-a "$nc" run -- python3 "$here/many.py" 10.214.0.2 9500 2000
  echo -n "  linux:      "; ip netns exec ncperf-a python3 "$here/many.py" 10.214.0.2 9501 2000
done
# Once each, netchannel first: a second run within a minute finds the client's ephemeral
# ports in TIME_WAIT after Linux's run (about 40,000 of them); netchannel's run makes none on
# the client's side (its connections are virtual) and its injections are loopback connections
# on the server's host.
echo "wrk -c 16 -d 3, Connection: close, requests/s"
echo -n "  netchannel: "; ip netns exec ncperf-a "$nc" run -- wrk -t 2 -c 16 -d 3 -H "Connection: close" \
  http://10.214.0.2:8089/ | grep -E "Requests/sec" | awk '{print $2}'
echo -n "  linux:      "; ip netns exec ncperf-a wrk -t 2 -c 16 -d 3 -H "Connection: close" \
  http://10.214.0.2:8091/ | grep -E "Requests/sec" | awk '{print $2}'

#!/usr/bin/env bash
# A connection per request: lighttpd serving a 4 KiB file between the ncperf namespaces, ab
# (HTTP/1.0, no keep-alive) with 10 concurrent clients, then the same with keep-alive (-k),
# kernel TCP and `netchannel run` (both ends) interleaved, ROUNDS rounds; prints requests/s.
# Usage: docs/bench/conn-churn/run.sh [NETCHANNEL] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../../.."
nc=${1:-./target/release/netchannel}
rounds=${2:-3}
dir=$(mktemp -d)
head -c 4096 /dev/urandom >"$dir/4k.bin"
printf 'server.document-root = "%s"\nserver.port = 9106\nserver.bind = "10.214.0.2"\n' "$dir" \
  >"$dir/lighttpd.conf"
one() { # STACK AB_ARGS...
  local stack=$1 wrap=()
  shift
  [[ $stack == netchannel ]] && wrap=("$nc" run --)
  ip netns exec ncperf-b "${wrap[@]}" lighttpd -D -f "$dir/lighttpd.conf" 2>/dev/null &
  local server=$!
  sleep 0.7
  local rps
  rps=$(ip netns exec ncperf-a "${wrap[@]}" ab -q "$@" "http://10.214.0.2:9106/4k.bin" 2>&1 |
    awk '/Requests per second/ {print $4}')
  kill "$server"
  wait "$server" 2>/dev/null || true
  echo "$stack ab $* : ${rps:-failed} requests/s"
}
for r in $(seq 1 "$rounds"); do
  for stack in linux netchannel; do
    one "$stack" -n 10000 -c 10
    one "$stack" -k -n 50000 -c 10
  done
done
rm -rf "$dir"

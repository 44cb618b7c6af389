#!/usr/bin/env bash
# A Node.js http server (srv.js) in ncperf-b, clients in ncperf-a, both under `netchannel run`:
# curl downloads and uploads 50 MB (checked by SHA-256 on both ends), then ab (20,000 requests,
# 50 concurrent; Node answers ab's HTTP/1.0 requests with a close, so a connection each) on
# kernel TCP and under netchannel, ROUNDS rounds interleaved. Usage: node-http.sh [ROUNDS]
# Needs node (Debian's nodejs; scripts/setup.sh does not install it: no test uses it).
set -euo pipefail
cd "$(dirname "$0")"
NC=${NC:-../../../target/release/netchannel}; rounds=${1:-3}
tmp=$(mktemp -d); export BIG=$tmp/big.bin
head -c 50000000 /dev/urandom >"$BIG"
want=$(sha256sum "$BIG" | cut -c1-16)
ip netns exec ncperf-b "$NC" run -- node srv.js & srv=$!; sleep 1.5
ip netns exec ncperf-a "$NC" run --stats -- curl -s http://10.214.0.2:8080/big -o "$tmp/got.bin"
echo "download: sent $want, received $(sha256sum "$tmp/got.bin" | cut -c1-16)"
echo "upload: sent 50000000 $want, server read $(ip netns exec ncperf-a "$NC" run -- curl -s --data-binary @"$BIG" http://10.214.0.2:8080/up)"
kill $srv; wait $srv 2>/dev/null || true
for r in $(seq 1 "$rounds"); do for v in linux netchannel; do
  w=(); [ "$v" = netchannel ] && w=("$NC" run --)
  ip netns exec ncperf-b "${w[@]}" node srv.js & srv=$!; sleep 1.5
  echo "$v: $(ip netns exec ncperf-a "${w[@]}" ab -q -n 20000 -c 50 -k http://10.214.0.2:8080/ 2>&1 | grep -E 'Failed|Requests per' | tr -s ' ' | tr '\n' ' ')"
  kill $srv; wait $srv 2>/dev/null || true
done; done
rm -r "$tmp"

#!/usr/bin/env bash
# redis4k GET between the namespaces: goodput, busy cores and the server's TCP retransmissions
# per stack, interleaved (a fresh server each run, its key set by a small SET first), then the
# server channel's `ss -ti` mid-run (spurious retransmissions, reordering) and one kernel-TCP
# iperf3 stream's retransmissions on the same veth. Needs the testbed (`ncperf testbed up`).
# Usage: docs/bench/redis4k-get/reorder.sh [NETCHANNEL] [ROUNDS] [netchannel-only]
set -uo pipefail
nc=${1:-target/release/netchannel}; rounds=${2:-3}
nc=$(realpath "$nc")
. "$(dirname "$0")/common.sh"
port=6420
one() { # stack
  local pre="" cpre="" spid r0 r1 t0 t1 i0 i1 out u n s i w q sq st carried=""
  rm -f /tmp/redis4k-get-stats.txt
  [ "$1" = netchannel ] && pre="$nc run --" && cpre="$nc run --stats-file /tmp/redis4k-get-stats.txt --"
  port=$((port + 1))
  start_server_with_key "$pre" $port
  r0=$(ip netns exec ncperf-b awk '/^Tcp: [0-9]/{print $13}' /proc/net/snmp)
  read -r _ u n s i w q sq st _ </proc/stat; t0=$((u+n+s+i+w+q+sq+st)); i0=$((i+w))
  out=$(ip netns exec ncperf-a $cpre redis-benchmark -h 10.214.0.2 -p $port -c 50 -P 16 \
    -t get -n 400000 -d 4096 --csv 2>/dev/null | grep GET | cut -d, -f2 | tr -d '"')
  read -r _ u n s i w q sq st _ </proc/stat; t1=$((u+n+s+i+w+q+sq+st)); i1=$((i+w))
  r1=$(ip netns exec ncperf-b awk '/^Tcp: [0-9]/{print $13}' /proc/net/snmp)
  [ "$1" = netchannel ] && carried="client: $(grep -o -E 'direct [0-9]+|kernel tcp [0-9]+' /tmp/redis4k-get-stats.txt | tr '\n' ' ')"
  echo "$1 GET/s $out $carried busy-cores $(python3 -c "print(round(2*(1-($i1-$i0)/($t1-$t0)),2))") server-retransmitted-segments $((r1 - r0))"
  kill $spid; wait $spid 2>/dev/null
  sleep 1
}
for r in $(seq 1 "$rounds"); do one linux; one netchannel; done
# `reorder.sh NETCHANNEL 0 netchannel-only`: one netchannel run and nothing else (lowat.sh).
[ "${3:-}" = netchannel-only ] && { one netchannel; exit 0; }
# The server's busiest channel mid-run, both ends.
port=$((port + 1))
start_server_with_key "$nc run --" $port
ip netns exec ncperf-a "$nc" run -- redis-benchmark -h 10.214.0.2 -p $port -c 50 -P 16 -t get \
  -n 1000000 -d 4096 -q >/dev/null 2>&1 &
cpid=$!
sleep 3
echo "server's channels (sender of the replies), ss -ti:"
ip netns exec ncperf-b ss -tin state established '( sport = :7450 )' | grep -E "bytes_acked:[0-9]{9}"
echo "client's channels (receiver), ss -ti:"
ip netns exec ncperf-a ss -tin state established '( dport = :7450 )' | grep -E "bytes_received:[0-9]{9}"
echo "server engine's channels (netchannel stat --json): bytes sent per channel"
ip netns exec ncperf-b "$nc" stat --json | python3 -c '
import json, sys
for e in json.load(sys.stdin)["engines"]:
    if e.get("command") == "redis-server":
        for p in e["peers"]:
            print(" ", [(c["class"], c["index"], c["tx_bytes"]) for c in p["channels"]])'
kill $cpid; wait $cpid 2>/dev/null; kill $spid; wait $spid 2>/dev/null
echo "one kernel-TCP iperf3 stream on the same veth (3 s):"
for len in 128K 4K; do
  ip netns exec ncperf-b iperf3 -s -B 10.214.0.2 -p 5320 -1 >/dev/null 2>&1 &
  sleep 1
  ip netns exec ncperf-a iperf3 -c 10.214.0.2 -p 5320 -t 3 -l $len -J 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)['end']['sum_sent']
print('  writes of $len: Gbit/s', round(d['bits_per_second'] / 1e9, 2), 'retransmits', d.get('retransmits'))"
  wait
done

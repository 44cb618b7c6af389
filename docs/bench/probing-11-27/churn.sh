#!/bin/bash
# churn.sh RANGE N PAR: a one-process Python echo server under `netchannel run` in ncperf-b
# with its ephemeral port range narrowed to RANGE ("40000 40015"), and PAR client threads in
# ncperf-a making N short connections each (`ncperf testbed up` first). Prints the client's
# failures and the server's path counters. NC picks the launcher (default: this checkout's).
here=$(cd "$(dirname "$0")" && pwd)
NC=${NC:-$here/../../../target/release/netchannel}
ip netns exec ncperf-b sysctl -q net.ipv4.ip_local_port_range="$1"
rm -f /tmp/churn-srv.stats
ip netns exec ncperf-b "$NC" run --port 7400 --stats-file /tmp/churn-srv.stats -- \
  python3 "$here/select_echo.py" 10.214.0.2 7401 &
sleep 1.5
timeout 120 ip netns exec ncperf-a "$NC" run --port 7400 -- \
  python3 "$here/churn_client.py" 10.214.0.2 7401 "$2" "$3" 2>&1 | tail -2
pkill -TERM -f "select_echo.py"; sleep 1
grep -E "accepted|relayed|direct" /tmp/churn-srv.stats | head
ip netns exec ncperf-b sysctl -q net.ipv4.ip_local_port_range="32768 60999"

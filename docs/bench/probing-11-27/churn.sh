#!/bin/bash
# run.sh RANGE N PAR
NC=${NC:-/work/main/target/release/netchannel}
ip netns exec ncperf-b sysctl -q net.ipv4.ip_local_port_range="$1"
rm -f srv.stats
ip netns exec ncperf-b $NC run --port 7400 --stats-file /tmp/race/srv.stats -- python3 srv.py 10.214.0.2 7401 &
sleep 1.5
timeout 120 ip netns exec ncperf-a $NC run --port 7400 --stats-file /tmp/race/cli.stats -- python3 cli.py 10.214.0.2 7401 $2 $3 2>&1 | tail -2
pkill -TERM -f "python3 srv.py"; sleep 1
grep -E "accepted|relayed|direct|kernel" srv.stats | head
ip netns exec ncperf-b sysctl -q net.ipv4.ip_local_port_range="32768 60999"

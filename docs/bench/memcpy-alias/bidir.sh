#!/usr/bin/env bash
# iperf3 --bidir -P 2 -t 4 between the namespaces, both ends under DIR/netchannel run (or
# `linux`: plain kernel TCP); prints the two directions' Gbit/s (receiver's figures).
# Usage: bidir.sh DIR|linux
d=$1
wrap=()
[[ $d != linux ]] && wrap=("$d/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" iperf3 -s -p 5301 -1 >/dev/null 2>&1 &
sleep 1
timeout 30 ip netns exec ncperf-a "${wrap[@]}" iperf3 -c 10.214.0.2 -p 5301 --bidir -t 4 -P 2 2>&1 |
  grep -E "SUM.*(0.00-4).*receiver" | awk '{print $6, $7}' | tr '\n' ' '
echo
wait

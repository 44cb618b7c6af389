#!/usr/bin/env bash
# iperf3 -P 8 (5 s) between the namespaces under DIR's `netchannel run`, NETCHANNEL_WORKERS_YIELD
# set per side. Usage: iperf3-per-side.sh SERVER(0|1) CLIENT(0|1) [DIR] (default target/release)
nc=${3:-target/release}/netchannel
ip netns exec ncperf-b env NETCHANNEL_WORKERS_YIELD=$1 $nc run -- iperf3 -s -B 10.214.0.2 -p 5301 -1 >/dev/null 2>&1 & s=$!
sleep 1
r=$(ip netns exec ncperf-a env NETCHANNEL_WORKERS_YIELD=$2 $nc run -- iperf3 -c 10.214.0.2 -p 5301 -P 8 -t 5 -J 2>/dev/null | python3 -c "import json,sys; print(round(json.load(sys.stdin)['end']['sum_received']['bits_per_second']/1e9,2))")
wait $s
echo "server $1 client $2: $r"

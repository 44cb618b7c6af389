#!/usr/bin/env bash
# Three more programs between the ncperf namespaces, each end under DIR's `netchannel run` (or
# kernel TCP with `linux`): netcat sending 50 MB with a half-close (-N) to a netcat that writes it
# out; iperf (2) with 4 parallel streams and in both directions at once (-d); lighttpd serving a
# 100 KB file to ab (keep-alive, 50 concurrent). Usage: more.sh linux|DIR
dir=$1; wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run ${STATS:+--stats-file $STATS} --)
tmp=$(mktemp -d); head -c 50000000 /dev/urandom > $tmp/in
# netcat, half-close: the receiver answers with the digest after the sender's FIN
ip netns exec ncperf-b "${wrap[@]}" sh -c "nc -l 10.214.0.2 7001 > $tmp/out" & s=$!
sleep 0.5
ip netns exec ncperf-a "${wrap[@]}" nc -N 10.214.0.2 7001 < $tmp/in; rc=$?
wait $s
echo "$dir nc: rc $rc $(cmp -s $tmp/in $tmp/out && echo same || echo DIFFERENT)"
# iperf 2
ip netns exec ncperf-b "${wrap[@]}" iperf -s -B 10.214.0.2 -p 5101 >/dev/null 2>&1 & s=$!
sleep 0.5
ip netns exec ncperf-a "${wrap[@]}" iperf -c 10.214.0.2 -p 5101 -P 4 -t 3 2>&1 | grep SUM | tail -1 | sed "s|^|$dir iperf -P 4: |"
ip netns exec ncperf-a "${wrap[@]}" iperf -c 10.214.0.2 -p 5101 -d -t 3 2>&1 | grep -E "sec" | sed "s|^|$dir iperf -d: |"
kill $s; wait $s 2>/dev/null
# lighttpd + ab
mkdir -p $tmp/www; head -c 100000 /dev/urandom > $tmp/www/f
cat > $tmp/l.conf <<CONF
server.document-root = "$tmp/www"
server.bind = "10.214.0.2"
server.port = 8081
server.max-keep-alive-requests = 1000
CONF
ip netns exec ncperf-b "${wrap[@]}" lighttpd -D -f $tmp/l.conf & s=$!
sleep 1
ip netns exec ncperf-a "${wrap[@]}" ab -q -k -n 20000 -c 50 http://10.214.0.2:8081/f 2>&1 | grep -E "Complete requests|Failed requests|Non-2xx|Requests per second|Total transferred" | tr -s ' ' | sed "s|^|$dir ab: |"
ip netns exec ncperf-a "${wrap[@]}" ab -q -n 5000 -c 20 http://10.214.0.2:8081/f 2>&1 | grep -E "Failed requests|Non-2xx|Requests per second" | tr -s ' ' | sed "s|^|$dir ab (no keep-alive): |"
kill $s; wait $s 2>/dev/null
rm -rf $tmp

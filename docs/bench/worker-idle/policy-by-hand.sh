#!/usr/bin/env bash
# redis4k GET (redis-benchmark -c 50 -P 16, 4 KiB values, 400,000 requests) with both ends under
# DIR's `netchannel run`, the engines' worker threads set by hand (chrt/renice) to POLICY:
# none, batch (SCHED_BATCH), idle (SCHED_IDLE), nice19, nice10; prints requests/s and the
# machine's busy and idle CPU per GET. Usage: policy-by-hand.sh DIR POLICY
dir=$1; pol=$2
wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6399 --bind 10.214.0.2 --save '' --protected-mode no >/dev/null 2>&1 & s=$!
sleep 1
ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 -t set -n 100000 -d 4096 -q -r 1000 >/dev/null 2>&1
setpol() { for t in $(ps -eLo tid,comm | awk '$2 ~ /^nc-worker/ {print $1}'); do
  case $pol in batch) chrt -b -p 0 $t;; idle) chrt -i -p 0 $t;; nice19) renice -n 19 -p $t >/dev/null;; nice10) renice -n 10 -p $t >/dev/null;; esac; done; }
setpol
( sleep 0.5; setpol ) &
read -r _ u1 n1 s1 i1 w1 q1 sq1 st1 _ < /proc/stat
r=$(ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 -t get -n 400000 -d 4096 -r 1000 --csv 2>/dev/null | tail -1 | cut -d, -f2)
read -r _ u2 n2 s2 i2 w2 q2 sq2 st2 _ < /proc/stat
kill $s; wait $s 2>/dev/null
python3 -c "
hz=100; n=400000
print('$pol', $r, 'busy %.2f idle %.2f us/GET'%((($u2-$u1)+($s2-$s1)+($q2-$q1)+($sq2-$sq1))/hz/n*1e6, (($i2-$i1)+($w2-$w1))/hz/n*1e6))"

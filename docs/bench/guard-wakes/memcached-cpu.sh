#!/usr/bin/env bash
# memcslap set (16 threads, 160,000 keys) against memcached -t 4 between the ncperf namespaces, on kernel
# TCP (`linux`) or both under DIR's `netchannel run`; prints the time and the machine's CPU per key
# (busy, idle, stolen, user, system) from /proc/stat.  Usage: docs/bench/guard-wakes/memcached-cpu.sh linux|DIR
dir=$1
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root &
server=$!; sleep 1
read -r _ u1 n1 s1 i1 w1 q1 sq1 st1 _ < /proc/stat
t=$(ip netns exec ncperf-a "${wrap[@]}" memcslap --servers=10.214.0.2:6392 --concurrency=16 --execute-number=10000 --test=set | grep "to set" | awk '{print $(NF-1)}')
read -r _ u2 n2 s2 i2 w2 q2 sq2 st2 _ < /proc/stat
kill $server; wait $server 2>/dev/null
hz=100; keys=160000
python3 -c "
busy=(($u2-$u1)+($n2-$n1)+($s2-$s1)+($q2-$q1)+($sq2-$sq1))/$hz; idle=(($i2-$i1)+($w2-$w1))/$hz; steal=($st2-$st1)/$hz
print('$dir', 'time $t s', 'busy %.1f us/key'%(busy/$keys*1e6), 'idle %.1f us/key'%(idle/$keys*1e6), 'steal %.1f us/key'%(steal/$keys*1e6), 'user %.1f sys %.1f us/key'%(($u2-$u1)/$hz/$keys*1e6, ($s2-$s1+$sq2-$sq1+$q2-$q1)/$hz/$keys*1e6))"

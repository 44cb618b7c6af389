#!/usr/bin/env bash
# Redis replication between the ncperf namespaces: a master in ncperf-b, a replica in ncperf-a,
# both under DIR's `netchannel run` (or kernel TCP with `linux`). The master holds 200,000 keys
# before the replica connects (full sync: diskless, or through an RDB file with DISKLESS=no),
# then takes 50,000 more writes (the replication stream); prints what the replica holds.
# Usage: redis-replica.sh linux|DIR
dir=$1; wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
tmp=$(mktemp -d)
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6400 --bind 10.214.0.2 --save '' --dir $tmp \
  --repl-diskless-sync ${DISKLESS:-yes} --repl-diskless-sync-delay 0 --protected-mode no --enable-debug-command yes >$tmp/master.log 2>&1 & m=$!
sleep 1
ip netns exec ncperf-b redis-cli -h 10.214.0.2 -p 6400 debug populate 200000 key 100 >/dev/null
ip netns exec ncperf-a "${wrap[@]}" redis-server --port 6401 --bind 10.214.0.1 --save '' --dir $tmp \
  --replicaof 10.214.0.2 6400 --protected-mode no --enable-debug-command yes >$tmp/replica.log 2>&1 & r=$!
for i in $(seq 1 100); do
  ip netns exec ncperf-a redis-cli -h 10.214.0.1 -p 6401 info replication | grep -q 'master_link_status:up' && break
  sleep 0.2
done
ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6400 -t set -n 50000 -r 1000000000 -q >/dev/null 2>&1
sleep 1
want=$(ip netns exec ncperf-b redis-cli -h 10.214.0.2 -p 6400 dbsize)
got=$(ip netns exec ncperf-a redis-cli -h 10.214.0.1 -p 6401 dbsize)
mdig=$(ip netns exec ncperf-b redis-cli -h 10.214.0.2 -p 6400 debug digest)
rdig=$(ip netns exec ncperf-a redis-cli -h 10.214.0.1 -p 6401 debug digest)
link=$(ip netns exec ncperf-a redis-cli -h 10.214.0.1 -p 6401 info replication | grep master_link_status | tr -d '\r')
echo "$dir diskless=${DISKLESS:-yes}: master $want keys, replica $got keys, $link, digests $([[ $mdig == $rdig ]] && echo equal || echo DIFFER)"
kill $m $r; wait $m $r 2>/dev/null
grep -h -i -E "error|fail|closed|refused" $tmp/*.log | grep -v overcommit | head -5; [[ -n $KEEP ]] && cp $tmp/*.log $KEEP/
rm -rf $tmp

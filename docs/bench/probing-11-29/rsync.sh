#!/usr/bin/env bash
# rsync between the ncperf namespaces: an rsync daemon (forks per connection) in ncperf-b, a
# client pulling and then pushing a tree (two 40 MB files and 2,000 small ones) in ncperf-a, both
# under DIR's `netchannel run` (or kernel TCP with `linux`); checks the trees are identical.
# Usage: rsync.sh linux|DIR
dir=$1; wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run ${STATS:+--stats-file $STATS} --)
tmp=$(mktemp -d); mkdir -p $tmp/src/small $tmp/pulled $tmp/pushed
head -c 40000000 /dev/urandom > $tmp/src/big1; head -c 40000000 /dev/urandom > $tmp/src/big2
for i in $(seq 1 2000); do head -c $((RANDOM % 5000)) /dev/urandom > $tmp/src/small/f$i; done
cat > $tmp/rsyncd.conf <<CONF
use chroot = no
[src]
path = $tmp/src
read only = yes
[dst]
path = $tmp/pushed
read only = no
uid = root
gid = root
CONF
ip netns exec ncperf-b "${wrap[@]}" rsync --daemon --no-detach --address=10.214.0.2 --port=8730 --config=$tmp/rsyncd.conf --log-file=$tmp/log & d=$!
sleep 1
t0=$(date +%s.%N)
ip netns exec ncperf-a "${wrap[@]}" rsync -a rsync://10.214.0.2:8730/src/ $tmp/pulled/; a=$?
t1=$(date +%s.%N)
ip netns exec ncperf-a "${wrap[@]}" rsync -a $tmp/src/ rsync://10.214.0.2:8730/dst/; b=$?
t2=$(date +%s.%N)
diff -r $tmp/src $tmp/pulled >/dev/null && p=same || p=DIFFERENT
diff -r $tmp/src $tmp/pushed >/dev/null && q=same || q=DIFFERENT
echo "$dir: pull rc $a $p ($(python3 -c "print(round($t1-$t0,2))") s), push rc $b $q ($(python3 -c "print(round($t2-$t1,2))") s)"
kill $d; wait $d 2>/dev/null; rm -rf $tmp

#!/usr/bin/env bash
# memcslap (4 threads, 8,000 sets) under callgrind, both sides under DIR's `netchannel run`
# between the ncperf namespaces; prints the client's instructions per key by library (OUT: callgrind's file).
# Usage: docs/bench/guard-wakes/callgrind.sh DIR OUT
dir=$1; out=$2; NC=$dir/netchannel
ip netns exec ncperf-b $NC run -- memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root & srv=$!; sleep 1
timeout 300 ip netns exec ncperf-a $NC run -- valgrind --tool=callgrind --callgrind-out-file=$out memcslap --servers=10.214.0.2:6392 --concurrency=4 --execute-number=2000 --test=set 2>&1 | grep -E "to set"
kill $srv; wait $srv 2>/dev/null
callgrind_annotate --inclusive=no --auto=no --threshold=100 $out 2>/dev/null | grep -E "^ *[0-9,]+ \(" | python3 -c "
import sys,re,collections
d=collections.Counter()
for l in sys.stdin:
    m=re.match(r'\s*([\d,]+) \(.*?\)\s+(.*)',l)
    if not m or 'PROGRAM TOTALS' in l: continue
    n=int(m.group(1).replace(',',''))
    o=re.search(r'\[([^\]]+)\]\s*$',m.group(2))
    obj=o.group(1).split('/')[-1] if o else ('libnetchannel_preload.so' if ('/rustc/' in m.group(2) or 'netchannel' in m.group(2) or '/rust/deps' in m.group(2)) else 'other')
    d[obj]+=n
tot=sum(d.values())
print(' '.join('%s %d'%(k,v/8000) for k,v in d.most_common(6)), 'total %d per key'%(tot/8000))
"

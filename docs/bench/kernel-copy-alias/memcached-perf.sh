#!/usr/bin/env bash
# memcslap set then get (16 threads, 160,000 keys each) against memcached -t 4 between the ncperf
# namespaces, both under DIR's `netchannel run` (or kernel TCP: `linux`), with the machine's
# samples recorded (perf, cpu-clock, 4 kHz, the server's counted); prints the server's and the clients' CPU per key
# in all, in _copy_to_iter and in _copy_from_iter. Usage: memcached-perf.sh linux|DIR OUT_PREFIX
dir=$1 out=$2
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root & server=$!
sleep 1
perf record -q -e cpu-clock -F 4000 -a -o "$out.data" 2>/dev/null & rec=$!
for t in set get; do
  ip netns exec ncperf-a "${wrap[@]}" memcslap --servers=10.214.0.2:6392 --concurrency=16 \
    --execute-number=10000 --test=$t | grep -E "to (set|get)"
done
kill -INT $rec; wait $rec 2>/dev/null
kill $server; wait $server 2>/dev/null
perf script -i "$out.data" -F pid,comm,ip,sym 2>/dev/null > "$out.samples"
python3 - "$out.samples" "$server" <<'PY'
import sys, collections
server = int(sys.argv[2]); us = 250 / 320000  # 4 kHz: a sample is 250 us; 320,000 keys
rows = [l.split() for l in open(sys.argv[1])]
rows = [r for r in rows if len(r) >= 3 and r[1].isdigit()]
clients = {int(r[1]) for r in rows if r[0] == 'memcslap'}
for who, pids in (('server', {server}), ('clients', clients)):
    c = collections.Counter()
    for r in rows:
        if int(r[1]) in pids:
            c['all'] += 1
            c[r[3] if len(r) > 3 else '?'] += 1
    print(f"{who}: {c['all'] * us:.1f} us/key of CPU; _copy_to_iter {c['_copy_to_iter'] * us:.2f}, "
          f"_copy_from_iter {c['_copy_from_iter'] * us:.2f} us/key")
PY
rm -f "$out.samples"

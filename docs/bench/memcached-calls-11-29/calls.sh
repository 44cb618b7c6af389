#!/usr/bin/env bash
# System calls and program-level epoll waits per key, by thread name: memcached -t 4 against
# memcslap (16 threads, 160,000 sets) between the ncperf namespaces, both under DIR's
# `netchannel run`, or on kernel TCP (`linux`). The program's own epoll_wait/sendmsg calls into
# the library are counted with uprobes on the library's exported symbols.
# Usage: calls.sh linux|DIR
dir=$1
wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ev="syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_epoll_pwait2"
ev="$ev,syscalls:sys_enter_read,syscalls:sys_enter_sendmsg,syscalls:sys_enter_write,sched:sched_switch"
if [[ $dir != linux ]]; then
  lib=$(readlink -f "$dir/libnetchannel_preload.so")
  perf probe -q -d 'probe_libnetchannel_preload:*' 2>/dev/null
  for f in epoll_wait sendmsg; do perf probe -q --no-inlines -x "$lib" -a "nc_$f=$f"; done
  ev="$ev,probe_libnetchannel_preload:nc_epoll_wait,probe_libnetchannel_preload:nc_sendmsg"
fi
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root & server=$!
sleep 1
perf record -q -e "$ev" -a -o /tmp/calls.data 2>/dev/null & rec=$!
sleep 0.5
ip netns exec ncperf-a "${wrap[@]}" memcslap --servers=10.214.0.2:6392 --concurrency=16 \
  --execute-number=10000 --test=set | grep -E "to set"
kill -INT $rec; wait $rec 2>/dev/null
kill $server; wait $server 2>/dev/null
perf script -i /tmp/calls.data -F comm,event 2>/dev/null |
  awk '{c[$1" "$2]++} END {for (k in c) printf "%-50s %6.2f\n", k, c[k]/160000}' |
  sort | grep -E "mc-worker|memcslap|nc-worker-0"
[[ $dir != linux ]] && perf probe -q -d 'probe_libnetchannel_preload:*'

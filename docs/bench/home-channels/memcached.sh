#!/usr/bin/env bash
# memcslap (16 threads, one connection each, poll before each read) against memcached -t 4, both
# under `netchannel run` in the ncperf namespaces, with the system calls and context switches of
# the whole machine per key (perf stat -a). Usage: memcached.sh DIR [RUN-OPTIONS...]
# DIR holds the `netchannel` launcher; RUN-OPTIONS go to `netchannel run` (e.g. --channels 16).
# `linux` as DIR runs both on kernel TCP. SYSCALLS="read sendmsg ..." picks the system calls counted.
set -euo pipefail
dir=$1; shift
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run "$@" --)
events=raw_syscalls:sys_enter,context-switches
for s in ${SYSCALLS:-epoll_wait epoll_pwait epoll_pwait2 read sendmsg recvfrom sendto ppoll poll write}; do
  events+=",syscalls:sys_enter_$s"
done
ip netns exec ncperf-b "${wrap[@]}" memcached -t 4 -l 10.214.0.2 -p 6392 -U 0 -u root &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
sleep 1
stat=$(mktemp)
perf stat -a -e "$events" -o "$stat" -- ip netns exec ncperf-a "${wrap[@]}" memcslap \
  --servers=10.214.0.2:6392 --concurrency=16 --execute-number=10000 --test=set | grep "to set"
grep -E '^ +[0-9,]+ ' "$stat" | awk '{gsub(",","",$1); printf "%-36s %6.2f per key\n", $2, $1/160000}'
rm -f "$stat"

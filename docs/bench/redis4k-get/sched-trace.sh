#!/usr/bin/env bash
# Usage: sched-trace.sh DIR|linux OUT.data: redis4k's GET phase (../session-11-25-morning/redis-get.sh:
# redis-server in ncperf-b, 400,000 GETs of 4 KiB with -c 50 -P 16 from ncperf-a, both under
# `netchannel run` from DIR, or kernel TCP) with sched_switch/wakeup and hrtimer events of the
# whole machine recorded over it. Then `perf script -i OUT.data > OUT.txt; python3
# thread-busy.py OUT.txt` gives each thread's busy time, and idle-states.py what the threads were
# doing while a CPU idled.
set -euo pipefail
here="$(dirname "$0")"
RECORD="perf record -q -e sched:sched_switch,sched:sched_wakeup,timer:hrtimer_expire_entry -a -o $2 --" \
  exec "$here/../session-11-25-morning/redis-get.sh" "$1"

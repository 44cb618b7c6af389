#!/usr/bin/env bash
# The allocator's share of the machine (glibc malloc and free symbols, system-wide samples) in
# the middle of a 10,000-flow 4 KiB run of the given ncperf build.
# Usage: alloc-share.sh NCPERF OUT.data
set -euo pipefail
bin=$1 data=$2
"$bin" run --stack netchannel --workload stream --pattern one-to-one --flows 10000 --size 4096 \
  --duration 4 >"$data.run.txt" 2>&1 &
sleep 3
perf record -a -g -e cpu-clock -F 2000 -o "$data" -- sleep 1.5 >/dev/null 2>&1
wait
perf report -i "$data" --no-children --sort sym -g none --stdio 2>/dev/null |
  awk '/\] (_int_malloc|_int_free|malloc|cfree@GLIBC_2.2.5|unlink_chunk.constprop.0|malloc_consolidate|_int_realloc|realloc)$/ {sub("%","",$1); s+=$1}
       END {printf "allocator %.1f%% of the machine\n", s}'
cat "$data.run.txt"

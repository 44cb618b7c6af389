#!/usr/bin/env bash
# Bulk writes spread over the channels' workers (Config::spread_bulk_writes), on a machine of
# 4 cores or more: OLD and NEW ncperf interleaved, netchannel rows, with Linux's figure once a
# round. Usage: spread-ab.sh OLD NEW ROUNDS OUT [TOOLS_DIR]; JSON per run in OUT.
# ROWS=t16: the 16-thread rows instead (every core busy).
set -u
old=$1 new=$2 rounds=$3 out=$4 tools=${5:-}
[ -n "$tools" ] && export PATH="$tools/bin:$PATH"
mkdir -p "$out"
hosts=netns; "$new" testbed up >/dev/null 2>&1 || hosts=loopback
echo "hosts=$hosts cores=$(nproc)" >"$out/machine.txt"
rows=(
 'stream1m-t1 --workload stream --size 1048576'
 'stream1m-t4 --workload stream --pattern one-to-one --flows 4 --max-apps 4 --size 1048576'
 'stream64k-t1 --workload stream --size 65536'
 'stream64-t1 --workload stream --size 64'
 'rr4k-t1 --workload rr --size 4096'
)
if [ "${ROWS:-}" = t16 ]; then # every core busy: do the workers still help, or only cost?
  rows=(
   'stream1m-t16 --workload stream --pattern one-to-one --flows 16 --max-apps 16 --size 1048576'
   'stream64k-t16 --workload stream --pattern one-to-one --flows 16 --max-apps 16 --size 65536'
   'rr4k-t16 --workload rr --pattern one-to-one --flows 16 --max-apps 16 --size 4096'
   'incast64-a16 --workload stream --pattern incast --flows 64 --size 65536 --max-apps 16'
  )
fi
for r in $(seq 1 "$rounds"); do
  "$new" run --stack linux --hosts "$hosts" --duration 3 --json --workload stream --size 1048576 \
      >"$out/linux-stream1m-t1-$r.json" 2>/dev/null
  for tag in new old; do
    bin=$new; [ $tag = old ] && bin=$old
    for row in "${rows[@]}"; do
      read -r -a a <<<"$row"
      timeout 30 "$bin" run --stack netchannel --hosts "$hosts" --duration 3 --json "${a[@]:1}" \
          >"$out/${a[0]}-$tag-$r.json" 2>/dev/null
    done
  done
done
python3 "$(dirname "$0")/ab-summary.py" "$out" goodput_gbps cpu_cores rps latency_us.p99

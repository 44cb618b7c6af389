#!/usr/bin/env bash
# Default session shards (one per core) against 16, interleaved, same ncperf binary.
# Usage: docs/bench/shards16/ab.sh NCPERF ROUNDS OUT; summary: docs/bench/ab-summary.py OUT KEYS
# ("old" = default shards, "new" = --shards 16).
set -euo pipefail
bin=$1 rounds=$2 out=$3
mkdir -p "$out"
rows=(
 'flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096'
 'rpc1000 --workload rr --pattern one-to-one --flows 1000 --size 4096'
 'incast64 --workload stream --pattern incast --flows 64 --size 65536'
 'a2a64 --workload stream --pattern all-to-all --flows 64 --size 65536'
 'mixed --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536'
 't8 --workload stream --pattern one-to-one --flows 8 --size 65536'
 'rr8 --workload rr --pattern one-to-one --flows 8 --size 4096'
)
for round in $(seq 1 "$rounds"); do
  for tag in new old; do
    extra=()
    [[ $tag == new ]] && extra=(--shards 16)
    for row in "${rows[@]}"; do
      read -r -a args <<<"$row"
      "$bin" run --stack netchannel --duration 3 --json "${args[@]:1}" "${extra[@]}" \
        >"$out/${args[0]}-$tag-$round.json"
    done
  done
done

#!/usr/bin/env bash
# One stream, write sizes 64 B to 1 MiB, netchannel against kernel TCP between the namespaces,
# each size one interleaved `ncperf compare` (3 repetitions of 3 s); JSON per size here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=${NCPERF:-./target/release/ncperf}
tag=${1:-after}
shift || true # further arguments go to every compare (e.g. --host-congestion)
for size in 64 1024 4096 16384 65536 1048576; do
  $N compare --workload stream --size "$size" --repetitions 3 --duration 3 --json "$@" \
    >"docs/bench/stall/$tag-$size.json"
done

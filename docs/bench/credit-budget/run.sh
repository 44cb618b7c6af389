#!/usr/bin/env bash
# The many-flow rows against the per-peer receive budget (`Config::max_peer_buffered`, 32 MiB by
# default): netchannel alone, each budget in turn, two interleaved rounds; then Linux's own
# figures beside (one `ncperf compare` per row). JSON here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=./target/release/ncperf
out=docs/bench/credit-budget
rr=(--workload rr --pattern one-to-one --flows 1000 --size 4096)
flows=(--workload stream --pattern one-to-one --flows 10000 --size 4096)
for round in 1 2; do
  for mib in 32 128 256 1024; do
    budget=(--max-peer-buffered $((mib << 20)))
    $N run --stack netchannel --duration 3 --json "${rr[@]}" "${budget[@]}" >"$out/rr1000-${mib}m-$round.json"
    $N run --stack netchannel --duration 3 --json "${flows[@]}" "${budget[@]}" >"$out/flows10k-${mib}m-$round.json"
  done
done
$N compare --repetitions 2 --duration 3 --json "${rr[@]}" >"$out/rr1000-compare.json"
$N compare --repetitions 2 --duration 3 --json "${flows[@]}" >"$out/flows10k-compare.json"

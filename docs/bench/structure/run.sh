#!/usr/bin/env bash
# Issue 15 before/after: the four single-flow rows and the 1,000-flow RPC, old and new binaries
# interleaved, each an `ncperf compare --repetitions 3 --duration 3` between the namespaces.
set -u
cd /work/bench/issue15
declare -A W=(
  [single-1m]="--workload stream --size 1048576"
  [single-4k]="--workload stream --size 4096"
  [single-64]="--workload stream --size 64"
  [rr-4k]="--workload rr --size 4096"
  [rr-4k-1000]="--workload rr --size 4096 --pattern one-to-one --flows 1000"
)
for round in 1 2; do
  for bin in before after15; do
    for w in single-1m single-4k single-64 rr-4k rr-4k-1000; do
      /work/bench-bin/$bin/ncperf compare --repetitions 3 --duration 3 --json ${W[$w]} > $bin-$w-$round.json 2> $bin-$w-$round.err
      echo "$(date +%T) $bin $w $round rc=$?"
    done
  done
done

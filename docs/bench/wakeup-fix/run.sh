#!/usr/bin/env bash
# One stream between the namespaces, write sizes 64 B to 1 MiB: the build before the lost
# wake-up fix (OLD, an ncperf binary built from f8b328e) against this one, interleaved (new,
# old, old, new per size); each run one `ncperf compare` (3 repetitions of 3 s, linux and
# netchannel interleaved). JSON per run here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OLD=${1:?usage: run.sh OLD_NCPERF}
NEW=./target/release/ncperf
out=docs/bench/wakeup-fix
for size in 64 1024 4096 16384 65536 1048576; do
  for run in new-1 old-1 old-2 new-2; do
    bin=$NEW
    [[ $run == old-* ]] && bin=$OLD
    $bin compare --workload stream --size "$size" --repetitions 3 --duration 3 --json \
      >"$out/$run-$size.json"
  done
done

#!/usr/bin/env bash
# The morning's rows (../data-path-11-24/run.sh) again after the lost wake-up fix; JSON here.
# With OLD (an ncperf built from f8b328e, the build before the fix): interleaved A/B of the rows
# where many senders wait for class space, `ncperf run` in four alternating pairs, into ab-*.json.
set -euo pipefail
here="$(dirname "$0")"
"$here/../data-path-11-24/run.sh" docs/bench/data-path-11-24-night
OLD=${1:-}
[[ -z $OLD ]] && exit 0
cd "$here/../../.."
for w in incast all-to-all; do
  for run in new-1 old-1 old-2 new-2 old-3 new-3 new-4 old-4; do
    bin=./target/release/ncperf
    [[ $run == old-* ]] && bin=$OLD
    $bin run --stack netchannel --workload stream --pattern "$w" --flows 64 --duration 3 --json \
      >"docs/bench/data-path-11-24-night/ab-$w-$run.json"
  done
done

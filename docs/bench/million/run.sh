#!/usr/bin/env bash
# A million concurrent streams against a thousand, interleaved (issue 18's row): per round
# `ncperf run --stack netchannel --workload stream --pattern one-to-one --flows F --size 4096
# --duration 3 --json` with F = 1,000 then 1,000,000. Usage: run.sh ROUNDS (JSON here).
set -euo pipefail
here="$(dirname "$0")"
cd "$here/../../.."
for round in $(seq 1 "${1:-3}"); do
  for flows in 1000 1000000; do
    ./target/release/ncperf run --stack netchannel --workload stream --pattern one-to-one \
      --flows "$flows" --size 4096 --duration 3 --json >"docs/bench/million/flows-$flows-$round.json"
  done
done

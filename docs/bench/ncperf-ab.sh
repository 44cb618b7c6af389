#!/usr/bin/env bash
# Interleaved A/B of two ncperf builds: per round, each row on the new build then the old one,
# `ncperf run --stack netchannel --duration 3 --json ARGS` into OUT/ROW-{new,old}-ROUND.json.
# Usage: docs/bench/ncperf-ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUT 'ROW ARGS...' ...
# Summarise with docs/bench/ab-summary.py OUT KEYS...
set -euo pipefail
old=$1 new=$2 rounds=$3 out=$4
shift 4
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for tag in new old; do
    bin=$new
    [[ $tag == old ]] && bin=$old
    for row in "$@"; do
      read -r -a args <<<"$row"
      "$bin" run --stack netchannel --duration 3 --json "${args[@]:1}" \
        >"$out/${args[0]}-$tag-$round.json"
    done
  done
done

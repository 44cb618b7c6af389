#!/usr/bin/env bash
# Forked servers (nginx's workers, PostgreSQL's backends): relayed (NETCHANNEL_FORKED=relay, the
# behaviour before) against the default (clients told to use kernel TCP once a connection of
# the listener went to a relay), interleaved, ROUNDS rounds of `ncperf programs --only
# nginx,pgbench --repetitions 1`, each with its own Linux run. Usage: ab.sh ROUNDS OUT_DIR
set -euo pipefail
rounds=$1; out=$2
mkdir -p "$out"
nc=$(dirname "$0")/../../../target/release/ncperf
for r in $(seq 1 "$rounds"); do
  NETCHANNEL_FORKED=relay "$nc" programs --only nginx,pgbench --repetitions 1 \
    --json "$out/relay-$r.json" >"$out/relay-$r.txt" 2>&1
  "$nc" programs --only nginx,pgbench --repetitions 1 --json "$out/kernel-$r.json" \
    >"$out/kernel-$r.txt" 2>&1
done

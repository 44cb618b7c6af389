#!/usr/bin/env bash
# A/B of the build before the worker/peers changes (OLD ncperf) against this one (target/release),
# interleaved, three pairs per workload, on the namespace testbed.
# Usage: docs/bench/peers/ab.sh OLD_NCPERF
set -euo pipefail
old=$1
new=target/release/ncperf
out=docs/bench/peers
run() { # label binary args...
  local label=$1 bin=$2; shift 2
  "$bin" run --stack netchannel --duration 3 --json "$@" > "$out/ab-$label.json.tmp"
  python3 - "$out/ab-$label.json.tmp" <<'PY' >> "$out/ab-$label.jsonl"
import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))
PY
  rm -f "$out/ab-$label.json.tmp"
}
rm -f $out/ab-*.jsonl
for i in 1 2 3; do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    run rr1-$side $bin --workload rr --size 4096
    run rr1000-$side $bin --workload rr --size 4096 --pattern one-to-one --flows 1000
    run stream1m-$side $bin --workload stream --size 1048576
    run incast-$side $bin --workload stream --pattern incast --flows 64
  done
done

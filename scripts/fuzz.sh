#!/usr/bin/env bash
# The long fuzz run (docs/PROTOCOL.md, "Fuzzing"): 10 million inputs for each fuzzed property,
# spread over every core. The same properties run with a small case count in `cargo test`.
#
# usage: scripts/fuzz.sh [TEST_BINARY]   (default: builds the library's test binary)
# Logs go to $OUT (default: target/fuzz-logs).
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${CASES:-10000000}
OUT=${OUT:-target/fuzz-logs}
mkdir -p "$OUT"
bin=${1:-}
if [[ -z $bin ]]; then
  bin=$(cargo test -q -p netchannel --lib --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("executable") and m.get("target",{}).get("kind")==["lib"]: print(m["executable"])' | tail -1)
fi
# The properties on a whole session take ~100x longer per input than the decoders: split them.
split=$(( $(nproc) > 4 ? $(nproc) / 2 : 2 ))
per=$(( CASES / split ))
echo "fuzz: $bin, $CASES inputs per property, session properties in $split processes"
start=$(date +%s)
pids=()
for i in $(seq "$split"); do
  for t in proto::tests::fuzz::arbitrary_bytes_into_a_channel \
           proto::tests::fuzz::hostile_frame_sequences_into_a_channel; do
    PROPTEST_CASES=$per "$bin" --exact "$t" >"$OUT/${t##*::}-$i.log" 2>&1 & pids+=($!)
  done
done
for t in wire::handshake::tests::arbitrary_handshakes_decode_or_fail_cleanly \
         wire::handshake::tests::proofs_bind_key_and_fields \
         wire::frame::tests::arbitrary_bytes_never_panic \
         wire::frame::tests::round_trip; do
  PROPTEST_CASES=$CASES "$bin" --exact "$t" >"$OUT/${t##*::}.log" 2>&1 & pids+=($!)
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
echo "fuzz: $(( $(date +%s) - start )) s on $(nproc) cores"
grep -h "test result" "$OUT"/*.log | sort | uniq -c
grep -l "minimal failing input" "$OUT"/*.log && failed=1
exit $failed

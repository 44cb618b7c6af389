#!/usr/bin/env bash
# A system-wide CPU profile (perf, cpu-clock, 4 s) of one `ncperf run` per stack, between the
# namespaces: shares by comm,dso and the top symbols. Usage: profile.sh NAME OUT_DIR -- RUN_ARGS
# e.g. profile.sh a2a docs/bench/intel-12-02 -- --workload stream --pattern all-to-all --flows 64
set -uo pipefail
cd "$(dirname "$0")/../../.."
name=$1; out=$2; shift 3
N=${NCPERF:-./target/release/ncperf}
for stack in linux netchannel; do
  $N run --stack $stack --duration 7 "$@" >"$out/$name-$stack-run.txt" 2>&1 &
  rpid=$!
  sleep 3
  perf record -q -e cpu-clock -a -g -o /tmp/prof-$name-$stack.data -- sleep 4 2>/dev/null
  wait $rpid
  perf report -i /tmp/prof-$name-$stack.data --no-children --stdio --sort comm,dso -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | grep "%" | head -20 >"$out/$name-$stack-comm-dso.txt"
  perf report -i /tmp/prof-$name-$stack.data --no-children --stdio --sort sym -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -40 >"$out/$name-$stack-sym.txt"
  sleep 1
done

#!/usr/bin/env bash
# CPU, page faults and wall time of one short-lived client process (`redis-cli ping` across
# the testbed), two builds of the interposition library against kernel TCP, interleaved:
# per round, `perf stat -r 20` (task-clock, page-faults) and 20 timed runs of each.
# The program is started with LD_PRELOAD directly (no launcher), so the figures are the
# library's and the engine's; both servers run under the NEW build (the server's side only
# answers). Usage: cpu.sh OLD_LIB NEW_LIB [ROUNDS]. Needs the testbed and redis.
set -euo pipefail
old=$1 new=$2 rounds=${3:-8}
bin=$(dirname "$new")/..
ip netns exec ncperf-b "$bin/netchannel" run --lib "$new" -- redis-server --port 9421 \
  --bind 10.214.0.2 --save '' --appendonly no --protected-mode no >/dev/null 2>&1 &
carried=$!
ip netns exec ncperf-b redis-server --port 9422 --bind 10.214.0.2 --save '' --appendonly no \
  --protected-mode no >/dev/null 2>&1 &
kernel=$!
trap 'kill $carried $kernel 2>/dev/null || true' EXIT
sleep 1
out=$(mktemp)
for r in $(seq "$rounds"); do
  for v in old new linux; do
    case $v in
      old) pre=(env LD_PRELOAD="$old"); port=9421 ;;
      new) pre=(env LD_PRELOAD="$new"); port=9421 ;;
      linux) pre=(env); port=9422 ;;
    esac
    cmd=("${pre[@]}" redis-cli -h 10.214.0.2 -p $port ping)
    st=$(ip netns exec ncperf-a perf stat -x, -r 20 -e task-clock,page-faults -- "${cmd[@]}" 2>&1 >/dev/null)
    tc=$(grep task-clock <<<"$st" | cut -d, -f1)
    pf=$(grep page-faults <<<"$st" | cut -d, -f1)
    t0=$(date +%s%N)
    for i in $(seq 20); do ip netns exec ncperf-a "${cmd[@]}" >/dev/null; done
    t1=$(date +%s%N)
    echo "$v $tc $pf $(( (t1 - t0) / 20000 ))" >>"$out"
  done
done
python3 - "$out" <<'PY'
import sys, statistics as st
d = {}
for l in open(sys.argv[1]):
    v, tc, pf, us = l.split()
    d.setdefault(v, []).append((float(tc), float(pf), float(us) / 1000))
for v in ("linux", "old", "new"):
    rows = d[v]
    def col(i):
        xs = sorted(r[i] for r in rows)
        return f"{st.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})"
    print(f"{v:6} task-clock ms {col(0)}  page faults {col(1)}  wall ms per run {col(2)}")
PY
rm -f "$out"

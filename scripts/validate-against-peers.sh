#!/usr/bin/env bash
# Honesty check: on the same testbed and in the same run, ncperf's linux stack must agree with
# the standard tools: stream goodput within 15% of iperf3, 4 KiB ping-pong p50 within 25% of
# sockperf. Runs interleave (peer, ncperf, peer, ncperf, ...) and compare medians.
# usage: scripts/validate-against-peers.sh [repetitions] [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
SECS=${2:-5}
bash scripts/setup.sh
cargo build --release --quiet -p ncperf
N=./target/release/ncperf
$N testbed up >/dev/null
A=(ip netns exec ncperf-a)
B=(ip netns exec ncperf-b)
SERVER=10.214.0.2
WRITE=131072 # iperf3's default TCP write size
# ncperf sets TCP_NODELAY on every socket (as netchannel does on its channels); iperf3 must too
# (-N), or the two measure different configurations (measured: 12.6 vs 19-26 Gbit/s on veth).

median() { python3 -c 'import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
json() { python3 -c 'import sys,json; d=json.load(sys.stdin); print(eval(sys.argv[1], {"d": d}))' "$1"; }

cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
PIDS=()
trap cleanup EXIT

"${B[@]}" iperf3 -s -p 5301 >/dev/null 2>&1 &
PIDS+=($!)
"${B[@]}" sockperf sr --tcp -i "$SERVER" -p 5302 >/dev/null 2>&1 &
PIDS+=($!)
sleep 1

iperf=() ; ncs=() ; sock=() ; ncr=()
for i in $(seq "$REPS"); do
  iperf+=("$("${A[@]}" iperf3 -c "$SERVER" -p 5301 -t "$SECS" -l "$WRITE" -N -J | json 'd["end"]["sum_received"]["bits_per_second"]/1e9')")
  ncs+=("$($N run --stack linux --workload stream --size "$WRITE" --duration "$SECS" --json | json 'd["goodput_gbps"]')")
  # sockperf reports half the round trip; ncperf's rr latency is the whole round trip.
  half=$("${A[@]}" sockperf pp --tcp -i "$SERVER" -p 5302 -m 4096 -t "$SECS" --mps=max 2>&1 |
    awk '/percentile 50.000/ {print $NF}')
  sock+=("$(python3 -c "print(2*float('$half'))")")
  ncr+=("$($N run --stack linux --workload rr --size 4096 --duration "$SECS" --json | json 'd["latency_us"]["p50"]')")
  echo "round $i: iperf3 ${iperf[-1]} Gbit/s, ncperf ${ncs[-1]} Gbit/s; sockperf p50 ${sock[-1]} us, ncperf p50 ${ncr[-1]} us" >&2
done

mi=$(median "${iperf[@]}"); mn=$(median "${ncs[@]}"); ms=$(median "${sock[@]}"); mr=$(median "${ncr[@]}")
python3 - "$mi" "$mn" "$ms" "$mr" <<'PY'
import sys
iperf, ncs, sock, ncr = map(float, sys.argv[1:])
g = ncs / iperf
l = ncr / sock
ok_g = abs(g - 1) <= 0.15
ok_l = abs(l - 1) <= 0.25
print(f"stream goodput: iperf3 {iperf:.2f} Gbit/s, ncperf linux {ncs:.2f} Gbit/s, ratio {g:.3f} "
      f"({'PASS' if ok_g else 'FAIL'}, limit 15%)")
print(f"4 KiB ping-pong p50: sockperf {sock:.1f} us (2 x half round trip), ncperf linux {ncr:.1f} us, "
      f"ratio {l:.3f} ({'PASS' if ok_l else 'FAIL'}, limit 25%)")
sys.exit(0 if ok_g and ok_l else 1)
PY

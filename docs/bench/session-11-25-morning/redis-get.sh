#!/usr/bin/env bash
# redis-benchmark's GET phase alone, 4 KiB values: redis-server in ncperf-b, 100,000 SETs to
# fill the key, then 400,000 GETs (-c 50 -P 16), both under `netchannel run` from DIR (or on
# kernel TCP with `linux`). Prints the GET line (requests/s second) and the machine's idle share
# during it. Usage: redis-get.sh DIR|linux. RECORD="perf record ... --" runs the GET phase under that
# command (docs/bench/redis4k-get/sched-trace.sh).
set -euo pipefail
dir=$1
wrap=()
[[ $dir != linux ]] && wrap=("$dir/netchannel" run --)
ip netns exec ncperf-b "${wrap[@]}" redis-server --port 6399 --bind 10.214.0.2 --protected-mode no \
  --save "" --appendonly no --daemonize no >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do ip netns exec ncperf-b ss -ltn | grep -q ':6399 ' && break; sleep 0.1; done
sleep 0.5
bench() { ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 "$@" -d 4096 --csv | tail -1; }
bench -t set -n 100000 >/dev/null
read -r _ u n s i w x y z _ </proc/stat; t0=$((u + n + s + i + w + x + y + z)); i0=$i
record=()
[[ -n ${RECORD:-} ]] && read -r -a record <<<"$RECORD"
"${record[@]}" ip netns exec ncperf-a "${wrap[@]}" redis-benchmark -h 10.214.0.2 -p 6399 -c 50 -P 16 \
  -t get -n 400000 -d 4096 --csv | tail -1
read -r _ u n s i w x y z _ </proc/stat; t1=$((u + n + s + i + w + x + y + z))
echo "idle $((100 * (i - i0) / (t1 - t0)))%"

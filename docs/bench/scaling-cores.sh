#!/usr/bin/env bash
# Issue 18's core-scaling curves: netchannel against Linux from 1 to 16 application
# threads (one stream per thread, one-to-one), for 1 MiB writes, 64 B writes and 4 KiB
# RPCs, and one application thread's 1 MiB stream spread over 1..16 channels.
# Usage: scaling-cores.sh NCPERF OUTDIR [THREADS...]   (each result: OUTDIR/<name>.json)
# Every row is one `ncperf compare` (both stacks interleaved, medians of --repetitions).
set -u
ncperf=${1:?ncperf binary}; out=${2:?output dir}; shift 2
threads=("$@"); [ ${#threads[@]} -gt 0 ] || threads=(1 2 4 8 16)
reps=${REPS:-2}; dur=${DUR:-2}; warm=${WARM:-1}
deadline=${DEADLINE:-100000} # seconds: rows that would start later are skipped
mkdir -p "$out"
hosts=netns
"$ncperf" testbed up >"$out/testbed.log" 2>&1 || hosts=loopback
echo "hosts=$hosts cores=$(nproc) kernel=$(uname -r)" | tee "$out/machine.txt"
lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)' >>"$out/machine.txt"
row() { # name, then ncperf compare arguments
    local name=$1; shift
    local t0=$SECONDS
    [ "$t0" -lt "$deadline" ] || { echo "$name skipped (deadline)"; return; }
    timeout 90 "$ncperf" compare --hosts "$hosts" --repetitions "$reps" --duration "$dur" \
        --warmup "$warm" --json "$@" >"$out/$name.json" 2>"$out/$name.err"
    local rc=$?
    python3 - "$out/$name.json" "$name" "$rc" "$((SECONDS - t0))" <<'PY'
import json, sys
path, name, rc, secs = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception:
    print(f"{name} rc={rc} {secs}s no result"); sys.exit()
m = "rps" if r["linux"].get("rps") else "goodput_gbps"
l, n = r["linux"], r["netchannel"]
print(f"{name} rc={rc} {secs}s {m} linux {l[m]:.4g} nc {n[m]:.4g} ratio {r['ratio'][m]:.3f}"
      f" cores linux {l['cpu_cores']:.2f} nc {n['cpu_cores']:.2f}"
      + (f" p99 linux {l['latency_us.p99']:.0f} nc {n['latency_us.p99']:.0f}" if m == "rps" else ""))
PY
}
for n in "${threads[@]}"; do
    row "stream1m-t$n" --workload stream --pattern one-to-one --flows "$n" --max-apps "$n" --size 1048576
done
for n in "${threads[@]}"; do
    row "rr4k-t$n" --workload rr --pattern one-to-one --flows "$n" --max-apps "$n" --size 4096
done
for n in "${threads[@]}"; do
    row "stream64-t$n" --workload stream --pattern one-to-one --flows "$n" --max-apps "$n" --size 64
done
for c in "${threads[@]}"; do
    row "single1m-c$c" --workload stream --pattern single --size 1048576 --channels "$c" --max-channels "$c"
done

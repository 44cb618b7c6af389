#!/usr/bin/env bash
# A lent many-core machine, between two network namespaces: issue 18's core-scaling curves
# (docs/bench/scaling-cores.sh) and its many-flow rows with 16 application threads a side.
# Usage: device-netns.sh NCPERF OUTDIR [TOOLS_DIR]
# TOOLS_DIR/bin holds `ip` and `ethtool` for a machine that has none (wrappers that run
# bundled binaries through their own loader); DEADLINE (seconds) bounds the whole run.
set -u
ncperf=${1:?ncperf} out=${2:?outdir} tools=${3:-}
[ -n "$tools" ] && export PATH="$tools/bin:$PATH"
mkdir -p "$out"
{ grep -E '^Cap(Eff|Bnd)' /proc/self/status; ip -V; unshare -n true && echo "unshare -n: ok"; } \
    >"$out/caps.txt" 2>&1
export DEADLINE=${DEADLINE:-300}
start=$SECONDS
bash "$(dirname "$0")/scaling-cores.sh" "$ncperf" "$out" 1 4 16 2>&1 | grep -v '^single1m' | tee "$out/rows.txt"
left=$(( ${TOTAL:-480} - (SECONDS - start) ))
hosts=$(grep -o 'hosts=[a-z]*' "$out/machine.txt" | cut -d= -f2)
for spec in \
  "flows10k-a16 --workload stream --pattern one-to-one --flows 10000 --size 4096 --max-apps 16" \
  "rpc1000-a16 --workload rr --pattern one-to-one --flows 1000 --size 4096 --max-apps 16" \
  "incast64-a16 --workload stream --pattern incast --flows 64 --size 65536 --max-apps 16" \
  "a2a64-a16 --workload stream --pattern all-to-all --flows 64 --size 65536 --max-apps 16"; do
  read -r -a a <<<"$spec"
  [ $((SECONDS - start)) -lt $(( ${TOTAL:-480} - 25 )) ] || { echo "${a[0]} skipped" | tee -a "$out/rows.txt"; continue; }
  timeout 80 "$ncperf" compare --hosts "$hosts" --repetitions 2 --duration 2 --warmup 1 --json "${a[@]:1}" \
      >"$out/${a[0]}.json" 2>"$out/${a[0]}.err"
  python3 - "$out/${a[0]}.json" "${a[0]}" <<'PY' | tee -a "$out/rows.txt"
import json, sys
try: r = json.load(open(sys.argv[1]))
except Exception: print(sys.argv[2], "no result"); sys.exit()
m = "rps" if r["linux"].get("rps") else "goodput_gbps"
l, n = r["linux"], r["netchannel"]
print(f"{sys.argv[2]} {m} linux {l[m]:.4g} nc {n[m]:.4g} ratio {r['ratio'][m]:.3f} per core linux {l['gbps_per_core']:.3g} nc {n['gbps_per_core']:.3g} cores {l['cpu_cores']:.2f}/{n['cpu_cores']:.2f}")
PY
done

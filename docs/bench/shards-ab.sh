#!/usr/bin/env bash
# Issue 18's rows with one session per peer against the default session shards, on this
# machine: each row `ncperf run` for linux, netchannel --shards 1 and netchannel with the
# engine's default shards, interleaved in each repetition. Usage: shards-ab.sh OUT.jsonl
# (a summary table goes to stdout; medians, with min-max). ONLY="row ..." runs those rows.
set -u
cd "$(dirname "$0")/../.."
N=./target/release/ncperf
out=${1:?jsonl}; reps=${REPS:-3}; dur=${DUR:-3}
: >"$out"
rows=(
  "rr-4k-1000|--workload rr --size 4096 --pattern one-to-one --flows 1000"
  "flows-10k-4k|--workload stream --pattern one-to-one --flows 10000 --size 4096"
  "incast-64|--workload stream --pattern incast --flows 64"
  "all-to-all-64|--workload stream --pattern all-to-all --flows 64"
  "mixed-1-8|--workload mixed --latency-flows 1 --throughput-flows 8 --size 65536"
  "t-alone-8|--workload mixed --latency-flows 0 --throughput-flows 8 --size 65536"
  "rr-4k-t2|--workload rr --size 4096 --pattern one-to-one --flows 2 --max-apps 2"
  "stream-64-t2|--workload stream --size 64 --pattern one-to-one --flows 2 --max-apps 2"
)
for rep in $(seq "$reps"); do
  for row in "${rows[@]}"; do
    name=${row%%|*}; args=${row#*|}
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
    for variant in linux nc-s1 nc-default; do
      case $variant in
        linux) extra=(--stack linux) ;;
        nc-s1) extra=(--stack netchannel --shards 1) ;;
        nc-default) extra=(--stack netchannel) ;;
      esac
      # shellcheck disable=SC2086
      r=$(timeout 120 $N run --hosts netns --duration "$dur" --json "${extra[@]}" $args 2>/dev/null | tail -1)
      [ -n "$r" ] || r='{}'
      echo "{\"row\":\"$name\",\"variant\":\"$variant\",\"result\":$r}" >>"$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, sys, statistics, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
order = []
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d["row"] not in order: order.append(d["row"])
    rows[d["row"]][d["variant"]].append(d["result"])
def metrics(r):
    m = {"Gbit/s": r.get("goodput_gbps"), "Gbit/s per core": r.get("gbps_per_core"), "rps": r.get("rps")}
    lat = r.get("latency_us") or {}
    m["p99 us"], m["p99.9 us"] = lat.get("p99"), lat.get("p999")
    return m
print("| row | metric | linux | nc, 1 shard | nc, default shards | default / 1 shard |")
print("|---|---|---:|---:|---:|---:|")
for row in order:
    for key in ["Gbit/s", "Gbit/s per core", "rps", "p99 us", "p99.9 us"]:
        cells = []
        for v in ["linux", "nc-s1", "nc-default"]:
            xs = [metrics(r)[key] for r in rows[row][v] if r and metrics(r)[key]]
            cells.append((statistics.median(xs), min(xs), max(xs)) if xs else None)
        if not any(cells) or (key == "rps" and not cells[0]): continue
        fmt = lambda c: "-" if not c else f"{c[0]:,.4g} ({c[1]:,.4g}-{c[2]:,.4g})"
        ratio = f"{cells[2][0] / cells[1][0]:.2f}" if cells[1] and cells[2] and cells[1][0] else "-"
        print(f"| {row} | {key} | {fmt(cells[0])} | {fmt(cells[1])} | {fmt(cells[2])} | {ratio} |")
PY

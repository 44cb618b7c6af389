#!/usr/bin/env bash
# Session shards against application threads: for 1 MiB writes, 64 B writes and 4 KiB RPCs,
# one stream per application thread (one-to-one), Linux and netchannel with
# Config::session_shards 1, 4 and 16, interleaved per repetition.
# Usage: shards-sweep.sh NCPERF OUTFILE.jsonl [THREADS...]   (a summary goes to stdout)
set -u
ncperf=${1:?ncperf}; out=${2:?jsonl}; shift 2
threads=("$@"); [ ${#threads[@]} -gt 0 ] || threads=(1 4 16)
reps=${REPS:-2}; dur=${DUR:-2}; warm=${WARM:-1}; shard_set=${SHARDS:-1 4 16}
hosts=netns
"$ncperf" testbed up >/dev/null 2>&1 || hosts=loopback
echo "hosts=$hosts cores=$(nproc)"
: >"$out"
one() { # label, then ncperf run arguments
    local label=$1; shift
    local r
    r=$(timeout 60 "$ncperf" run --hosts "$hosts" --duration "$dur" --warmup "$warm" --json "$@" 2>/dev/null | tail -1)
    [ -n "$r" ] || r='{}'
    echo "{\"label\":\"$label\",\"result\":$r}" >>"$out"
}
for w in "stream1m stream 1048576" "rr4k rr 4096" "stream64 stream 64"; do
    set -- $w; name=$1; workload=$2; size=$3
    for n in "${threads[@]}"; do
        args=(--workload "$workload" --pattern one-to-one --flows "$n" --max-apps "$n" --size "$size")
        for rep in $(seq "$reps"); do
            one "$name t$n linux" --stack linux "${args[@]}"
            if [ "$n" -eq 1 ]; then
                one "$name t$n nc-s1" --stack netchannel --shards 1 "${args[@]}"
            else
                for s in $shard_set; do one "$name t$n nc-s$s" --stack netchannel --shards "$s" "${args[@]}"; done
            fi
        done
    done
done
python3 - "$out" <<'PY'
import json, sys, statistics, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    d = json.loads(line); r = d["result"]
    if not r: rows[d["label"]].append(None); continue
    m = r["rps"] if r.get("rps") else r["goodput_gbps"]
    rows[d["label"]].append((m, r["cpu_cores"], (r.get("latency_us") or {}).get("p99")))
for label, v in rows.items():
    ok = [x for x in v if x]
    if not ok: print(f"{label:24} failed"); continue
    med = statistics.median(x[0] for x in ok)
    print(f"{label:24} median {med:12.4g}  runs {' '.join(f'{x[0]:.4g}' for x in ok)}  cores {statistics.median(x[1] for x in ok):.2f}"
          + (f"  p99 {statistics.median(x[2] for x in ok if x[2] is not None):.0f}" if ok[0][2] is not None else ""))
PY

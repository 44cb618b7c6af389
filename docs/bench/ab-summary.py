#!/usr/bin/env python3
"""Medians and every round of an interleaved A/B's JSON files (ROW-TAG-ROUND.json, from
ncperf run --json): ab-summary.py DIR [KEY...] (default keys: goodput_gbps, cpu_cores; a
latency percentile is latency_us.p50, latency_us.p99, ...: a dotted key looks inside)."""
import collections, glob, json, os, statistics, sys
out = sys.argv[1]
keys = sys.argv[2:] or ["goodput_gbps", "cpu_cores"]
def value(run, key):
    for part in key.split("."):
        run = (run or {}).get(part)
    return run

runs = collections.defaultdict(list)
for f in sorted(glob.glob(f"{out}/*-*-*.json")):
    row, tag, _ = os.path.basename(f)[:-5].rsplit("-", 2)
    runs[(row, tag)].append(json.load(open(f)))
for row in sorted({r for r, _ in runs}):
    for key in keys:
        for tag in ("old", "new"):
            vals = [value(r, key) for r in runs.get((row, tag), [])]
            vals = [v for v in vals if v is not None]
            if vals:
                print(f"{row:10} {key:14} {tag}: median {statistics.median(vals):12.2f}  runs "
                      + ", ".join(f"{v:.2f}" for v in vals))

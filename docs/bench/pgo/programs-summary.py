#!/usr/bin/env python3
"""Medians of an interleaved programs A/B (docs/bench/programs-ab.sh): programs-summary.py DIR.
For each program and metric: netchannel's figure on the old and the new build (median and runs)
and Linux's from the same rounds."""
import collections, glob, json, statistics, sys
d = sys.argv[1]
vals = collections.defaultdict(list)
for f in sorted(glob.glob(f"{d}/*-*.json")):
    tag = f.rsplit("/", 1)[1].split("-")[0]
    for s in json.load(open(f))["summaries"]:
        key = (s["program"], s["metric"])
        vals[key + (tag,)].append(s["netchannel"])
        vals[key + ("linux",)].append(s["linux"])
for prog, metric in sorted({k[:2] for k in vals}):
    row = []
    for tag in ("old", "new", "linux"):
        v = vals[(prog, metric, tag)]
        row.append(f"{tag} {statistics.median(v):12.2f} ({', '.join(f'{x:.1f}' for x in v)})")
    print(f"{prog:9} {metric:16} " + "  ".join(row))

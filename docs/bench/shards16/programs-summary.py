#!/usr/bin/env python3
"""Medians of an interleaved programs A/B (DIR/{old,new}-ROUND.json from ncperf programs --json):
netchannel's figure and its ratio to the same round's Linux, per build. Usage: programs-summary.py DIR"""
import collections, glob, json, os, statistics, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-*.json"))):
    tag = os.path.basename(f).split("-")[0]
    for s in json.load(open(f))["summaries"]:
        rows[(s["program"], s["metric"])][tag].append((s["netchannel"], s["ratio"], s["linux"]))
for (prog, metric), tags in sorted(rows.items()):
    for tag in ("old", "new"):
        v = tags.get(tag, [])
        if not v:
            continue
        nc = statistics.median(x[0] for x in v)
        ratio = statistics.median(x[1] for x in v)
        print(f"{prog:10} {metric:14} {tag}: netchannel median {nc:12.2f} (ratio median {ratio:.2f}) "
              + "runs " + ", ".join(f"{x[0]:.1f}/{x[2]:.1f}" for x in v))

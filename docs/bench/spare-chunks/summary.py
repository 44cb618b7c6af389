#!/usr/bin/env python3
"""Per row and build: each round's figure and the median (ab.sh's JSON files)."""
import glob, json, statistics, sys
out = sys.argv[1]
for row, key in (("flows10k", "gbps_per_core"), ("flows10k", "goodput_gbps"), ("rr1000", "rps"), ("rr1000", "cpu_cores"), ("stream4k", "goodput_gbps"), ("stream4k", "cpu_cores")):
    for tag in ("old", "new"):
        vals = [json.load(open(f))[key] for f in sorted(glob.glob(f"{out}/{row}-{tag}-*.json"))]
        if vals:
            print(f"{row:9} {key:14} {tag}: median {statistics.median(vals):10.2f}  runs {', '.join(f'{v:.2f}' for v in vals)}")

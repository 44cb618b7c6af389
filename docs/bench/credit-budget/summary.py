#!/usr/bin/env python3
"""run.sh's figures: netchannel per budget (both rounds), and Linux's from the compare runs."""
import glob, json, os
here = os.path.dirname(os.path.abspath(__file__))
for row, key in (("rr1000", "rps"), ("flows10k", "gbps_per_core")):
    linux = [r[key] for r in json.load(open(f"{here}/{row}-compare.json"))["runs"] if r["stack"] == "linux"]
    nc = [r[key] for r in json.load(open(f"{here}/{row}-compare.json"))["runs"] if r["stack"] == "netchannel"]
    print(f"{row} {key}: linux {', '.join(f'{v:,.2f}' for v in linux)}; netchannel (default budget, compare) {', '.join(f'{v:,.2f}' for v in nc)}")
    for mib in (32, 128, 256, 1024):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{here}/{row}-{mib}m-*.json"))]
        figures = ", ".join(f"{r[key]:,.2f}" for r in runs)
        rss = ", ".join(f"{r['server_rss_per_flow'] / 1024:.0f}" for r in runs)
        print(f"  {mib:5} MiB: {figures}  (server resident per flow {rss} KiB)")

#!/usr/bin/env python3
"""The rows of run.sh (or of the directory given): per stack the median and range of the 3
repetitions, and the ratio."""
import json, statistics, sys, os
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = [("rr-4k", ["latency_us.p50", "latency_us.p99"]), ("rr-4k-1000", ["rps"]),
        ("flows-10k-4k", ["gbps_per_core", "goodput_gbps"]), ("incast-64", ["goodput_gbps", "gbps_per_core"]),
        ("all-to-all-64", ["goodput_gbps", "gbps_per_core"]),
        ("mixed-1-8", ["goodput_gbps", "rps", "latency_us.p50", "latency_us.p99", "latency_us.p999"]),
        ("t-alone-8", ["goodput_gbps", "gbps_per_core"])]
def val(run, key):
    if key.startswith("latency_us."):
        return (run.get("latency_us") or {}).get(key.split(".")[1])
    return run.get(key)
for name, keys in rows:
    d = json.load(open(f"{here}/{name}.json"))
    for key in keys:
        cells = []
        for stack in ("linux", "netchannel"):
            v = [val(r, key) for r in d["runs"] if r["stack"] == stack]
            v = [x for x in v if x is not None]
            cells.append(f"{statistics.median(v):,.2f} ({min(v):,.2f}-{max(v):,.2f})")
        print(f"| {name} | {key} | {cells[0]} | {cells[1]} | {d['ratio'][key]:.2f} |")

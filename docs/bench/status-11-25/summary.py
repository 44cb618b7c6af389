#!/usr/bin/env python3
"""Where issue 17's and 18's targets stand: the rows of run.sh (median and range of the
repetitions per stack, the ratio, the target), each beside the same row's ratio on the earlier
days whose JSON is in docs/bench (the spread over days). Prints Markdown tables.
Usage: summary.py [DIR [STALL_TAG]]: the JSON of run.sh in DIR (default: this directory) and
the one-stream sweep tagged STALL_TAG (default: 11-25-midday); for another directory than this
one, this directory's runs count among the earlier days."""
import json, os, statistics, sys

bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
here = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(bench, "status-11-25")
stall_tag = sys.argv[2] if len(sys.argv) > 2 else "11-25-midday"
EARLIER = ["data-path-11-24", "data-path-11-24-evening", "data-path-11-24-night",
           "data-path-11-25", "data-path-11-25-credit", "data-path-11-25-homes", "pool-classes"]
if os.path.basename(here) != "status-11-25":
    EARLIER.append("status-11-25")


def val(run, key):
    if key.startswith("latency_us."):
        return (run.get("latency_us") or {}).get(key.split(".")[1])
    return run.get(key)


def load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def cell(d, stack, key, fmt="{:,.2f}"):
    v = [x for x in (val(r, key) for r in d["runs"] if r["stack"] == stack) if x is not None]
    m = statistics.median(v)
    return f"{fmt.format(m)} ({fmt.format(min(v))}-{fmt.format(max(v))})", m


def earlier(name, key, derive=None):
    out = []
    for day in EARLIER:
        d = load(f"{bench}/{day}/{name}.json")
        if d is None:
            continue
        r = derive(day) if derive else (d["ratio"] or {}).get(key)
        if r is not None:
            out.append(f"{r:.2f}")
    return ", ".join(out) or "-"


def ok(ratio, target):
    op, bound = target
    met = ratio >= bound if op == ">=" else ratio <= bound
    return f"{op} {bound}: {'met' if met else '**missed**'}"


print("| row | linux | netchannel | ratio | target | earlier days' ratios |")
print("|---|---:|---:|---:|---|---|")
rows = [
    ("rr-4k", "latency_us.p50", "one 4 KiB RPC flow: p50 us", ("<=", 1.15), "{:,.0f}"),
    ("rr-4k", "latency_us.p99", "one 4 KiB RPC flow: p99 us", ("<=", 1.3), "{:,.0f}"),
    ("rr-4k-1000", "rps", "1,000-flow 4 KiB RPC: requests/s", (">=", 1.5), "{:,.0f}"),
    ("flows-10k-4k", "gbps_per_core", "10,000 flows x 4 KiB: Gbit/s per core", (">=", 1.5), "{:,.2f}"),
    ("incast-64", "goodput_gbps", "incast 64: Gbit/s", (">=", 1.0), "{:,.2f}"),
    ("incast-64", "gbps_per_core", "incast 64: Gbit/s per core", (">=", 1.0), "{:,.2f}"),
    ("all-to-all-64", "goodput_gbps", "all-to-all 64: Gbit/s", (">=", 1.0), "{:,.2f}"),
    ("all-to-all-64", "gbps_per_core", "all-to-all 64: Gbit/s per core", (">=", 1.0), "{:,.2f}"),
    ("mixed-1-8", "latency_us.p999", "1 L + 8 T: L p99.9 us", ("<=", 0.1), "{:,.0f}"),
    ("mixed-1-8", "latency_us.p99", "1 L + 8 T: L p99 us", None, "{:,.0f}"),
    ("mixed-1-8", "rps", "1 L + 8 T: L requests/s", None, "{:,.0f}"),
]
for name, key, label, target, fmt in rows:
    d = load(f"{here}/{name}.json")
    lx, _ = cell(d, "linux", key, fmt)
    nc, _ = cell(d, "netchannel", key, fmt)
    r = d["ratio"][key]
    print(f"| {label} | {lx} | {nc} | {r:.2f} | {ok(r, target) if target else '-'} | {earlier(name, key)} |")


def beside(directory):
    m, a = load(f"{directory}/mixed-1-8.json"), load(f"{directory}/t-alone-8.json")
    if not (m and a):
        return None
    return m["netchannel"]["goodput_gbps"] / a["netchannel"]["goodput_gbps"]


mixed, alone = load(f"{here}/mixed-1-8.json"), load(f"{here}/t-alone-8.json")
_, t_mixed = cell(mixed, "netchannel", "goodput_gbps")
_, t_alone = cell(alone, "netchannel", "goodput_gbps")
_, l_alone = cell(alone, "linux", "goodput_gbps")
r = t_mixed / t_alone
print(f"| T beside L / T alone (netchannel) | - | {t_mixed:.2f} / {t_alone:.2f} Gbit/s | {r:.2f} | "
      f"{ok(r, ('>=', 0.85))} | {earlier('mixed-1-8', None, lambda day: beside(f'{bench}/{day}'))} |")
print(f"| 8 T alone: Gbit/s | {cell(alone, 'linux', 'goodput_gbps')[0]} | "
      f"{cell(alone, 'netchannel', 'goodput_gbps')[0]} | {alone['ratio']['goodput_gbps']:.2f} | - | "
      f"{earlier('t-alone-8', 'goodput_gbps')} |")

print()
print("| one stream, write size | linux Gbit/s | netchannel Gbit/s | ratio | netchannel busy cores "
      "| target |")
print("|---|---:|---:|---:|---:|---|")
for size in (64, 1024, 4096, 16384, 65536, 1048576):
    d = load(f"{bench}/stall/{stall_tag}-{size}.json")
    if d is None:
        continue
    r = d["ratio"]["goodput_gbps"]
    target = ok(r, (">=", 1.0)) if size >= 4096 else "no idling"
    busy = cell(d, "netchannel", "cpu_cores")[0]
    print(f"| {size:,} B | {cell(d, 'linux', 'goodput_gbps')[0]} | "
          f"{cell(d, 'netchannel', 'goodput_gbps')[0]} | {r:.2f} | {busy} | {target} |")

p = load(f"{here}/programs.json")
if p:
    print()
    print("| program | metric | linux | netchannel | ratio | target | paths (client / server) |")
    print("|---|---|---:|---:|---:|---|---|")
    targets = {("redis16", "SET"): (">=", 1.0), ("redis16", "GET"): (">=", 1.0),
               ("redis4k", "SET"): (">=", 1.0), ("redis4k", "GET"): (">=", 1.0),
               ("memcached", "set"): (">=", 1.0), ("memcached", "get"): (">=", 1.0),
               ("iperf3", "-P 8 goodput"): (">=", 0.95), ("sockperf", "p50"): ("<=", 1.1),
               ("sockperf", "p99"): ("<=", 1.3)}
    for s in p["summaries"]:
        key = next((t for (prog, m), t in targets.items()
                    if prog == s["program"] and s["metric"].endswith(m)), None)
        r = s["ratio"]
        paths = s.get("paths") or []
        def side(direct, relayed, kernel=None):
            if direct is None:
                return "no stats line"
            return f"direct {direct}, relayed {relayed}" + ("" if kernel is None else f", kernel tcp {kernel}")
        # Four figures per run before ncperf counted kernel TCP connections too, six after.
        if len(paths) == 4:
            path = f"{side(paths[0], paths[1])} / {side(paths[2], paths[3])}"
        elif len(paths) == 6:
            path = f"{side(*paths[0:3])} / {side(*paths[3:6])}"
        else:
            path = "-"
        print(f"| {s['program']} | {s['metric']} | {s['linux']:,.1f} | {s['netchannel']:,.1f} | "
              f"{r:.2f} | {ok(r, key) if key else 'reported'} | {path} |")

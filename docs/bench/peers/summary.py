"""Medians (and ranges) of docs/bench/peers/*.json: python3 docs/bench/peers/summary.py"""
import glob, json, statistics

def load(pattern):
    return [json.load(open(f)) for f in sorted(glob.glob(f"docs/bench/peers/{pattern}"))]

def med(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else None

for kind in ["rate", "closed"]:
    for name in ["linux", "peers1", "peers100", "peers1000"]:
        rows = load(f"{kind}-{name}-*.json")
        if not rows:
            continue
        rps = med([r["rps"] for r in rows])
        srv = med([r["server_cpu_cores"] for r in rows])
        cli = med([r["client_cpu_cores"] for r in rows])
        us_per_rpc = med([r["server_cpu_cores"] / r["rps"] * 1e6 for r in rows])
        p50 = med([r["latency_us"]["p50"] for r in rows])
        p99 = med([r["latency_us"]["p99"] for r in rows])
        conn = med([(r.get("new_peer_connect_ms") or {}).get("p50") for r in rows])
        conn99 = med([(r.get("new_peer_connect_ms") or {}).get("p99") for r in rows])
        rss = med([r.get("server_rss_per_flow") for r in rows])
        fds = med([r.get("server_fds_per_flow") for r in rows])
        f = lambda m, d=0: "-" if m is None else f"{m[0]:,.{d}f} ({m[1]:,.{d}f}-{m[2]:,.{d}f})"
        print(f"{kind:6} {name:9} rps {f(rps)} | server cores {f(srv,2)} us/RPC {f(us_per_rpc,1)} | "
              f"client cores {f(cli,2)} | p50 {f(p50)} p99 {f(p99)} | connect p50 {f(conn,2)} "
              f"p99 {f(conn99,2)} ms | server per flow {f(rss)} B {f(fds,1)} fds")

#!/usr/bin/env python3
"""Reads a `perf record` of sched_switch/sched_wakeup/softirq_entry/softirq_exit (system-wide)
and prints: each thread's wake-up latency (wake-up to running), the softirq run durations, what
ran on the CPU while the named threads waited more than 300 us for it, and (for a client and a
server thread, the first two named) each round trip between them split into its parts.

    sched-trace.py PERF_DATA THREAD[,THREAD...]
"""
import collections
import re
import subprocess
import sys

data, targets = sys.argv[1], set(sys.argv[2].split(","))
text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,tid,cpu,time,event,trace"],
                      capture_output=True, text=True, check=True).stdout
line_re = re.compile(r"^\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)$")
woken = {}                                # tid -> (time, comm)
latency = collections.defaultdict(list)   # comm -> wake-up latencies, us
softirq_open = {}                         # cpu -> (vector, start)
softirq = collections.defaultdict(list)   # vector -> durations, us
slices = collections.defaultdict(list)    # cpu -> [(start, end, comm)] of what ran
on_cpu = {}                               # cpu -> (comm, since)
blame = collections.Counter()
slow = 0
first = last = None
for line in text.splitlines():
    m = line_re.match(line)
    if not m:
        continue
    cpu, t, event, trace = int(m.group(3)), float(m.group(4)), m.group(5), m.group(6)
    first = t if first is None else first
    last = t
    if event == "sched:sched_wakeup":
        w = re.search(r"comm=(.*?) pid=(\d+)", trace)
        if w:
            woken[int(w.group(2))] = (t, w.group(1))
    elif event == "sched:sched_switch":
        s = re.search(r"==> next_comm=(.*?) next_pid=(\d+)", trace)
        if not s:
            continue
        if cpu in on_cpu:
            comm, since = on_cpu[cpu]
            slices[cpu].append((since, t, comm))
            del slices[cpu][:-500]
        on_cpu[cpu] = (s.group(1), t)
        pid = int(s.group(2))
        if pid in woken:
            t0, comm = woken.pop(pid)
            waited = (t - t0) * 1e6
            latency[comm].append(waited)
            if comm in targets and waited > 300:
                slow += 1
                for start, end, who in slices[cpu]:
                    if end > t0 and start < t:
                        blame[who] += (min(end, t) - max(start, t0)) * 1e6
    elif event == "irq:softirq_entry":
        v = re.search(r"action=(\w+)", trace)
        softirq_open[cpu] = (v.group(1) if v else "?", t)
    elif event == "irq:softirq_exit" and cpu in softirq_open:
        vector, t0 = softirq_open.pop(cpu)
        softirq[vector].append((t - t0) * 1e6)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] if values else 0.0


span = (last - first) if first is not None else 1.0
print("wake-up latency, us            count      p50      p99    p99.9      max")
for comm, v in sorted(latency.items(), key=lambda kv: -len(kv[1]))[:14]:
    print(f"  {comm:24s} {len(v):8d} {pct(v, .5):8.1f} {pct(v, .99):8.1f} "
          f"{pct(v, .999):8.1f} {max(v):8.1f}")
print("softirq runs, us               count      p50      p99    p99.9      max  CPU share")
for vector, v in sorted(softirq.items(), key=lambda kv: -sum(kv[1])):
    share = sum(v) / 1e6 / (span * 2) * 100
    print(f"  {vector:24s} {len(v):8d} {pct(v, .5):8.1f} {pct(v, .99):8.1f} "
          f"{pct(v, .999):8.1f} {max(v):8.1f}  {share:5.1f}% of 2 cores")
total = sum(blame.values()) or 1.0
print(f"while {', '.join(sorted(targets))} waited > 300 us for a CPU ({slow} times), it ran:")
for who, us in blame.most_common(10):
    print(f"  {who:24s} {us / 1e3:8.2f} ms {us / total * 100:5.1f}%")

# Round trips between the first two named threads (client, server): each one split into the
# server's wake-up latency, the server's time from running to waking the client with the reply
# (on CPU, preempted, blocked), and the client's wake-up latency.
names = sys.argv[2].split(",")
if len(names) >= 2:
    client, server = names[0], names[1]
    rpcs = []
    cur = None
    on_since = off_since = None
    off_why = None
    preempted_by = collections.Counter()
    for line in text.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        comm, t, event, trace = m.group(1), float(m.group(4)), m.group(5), m.group(6)
        if event == "sched:sched_wakeup":
            w = re.search(r"comm=(.*?) pid=", trace)
            if not w:
                continue
            if w.group(1) == server and comm == client:
                cur = {"woken": t, "on": 0.0, "preempted": 0.0, "blocked": 0.0}
                on_since = None
            elif cur and w.group(1) == server and "ran" in cur and off_why == "S":
                cur["blocked"] += t - off_since
                off_since, off_why = t, "woken"
            elif cur and w.group(1) == client and comm == server and "ran" in cur:
                if on_since is not None:
                    cur["on"] += t - on_since
                cur["replied"] = t
        elif event == "sched:sched_switch":
            s = re.search(r"prev_comm=(.*?) prev_pid=\d+ prev_prio=\d+ prev_state=(\S+) ==> "
                          r"next_comm=(.*?) next_pid=", trace)
            if not s or not cur:
                continue
            if s.group(3) == server and "replied" not in cur:
                if "ran" not in cur:
                    cur["ran"] = t
                elif off_why == "R":
                    cur["preempted"] += t - off_since
                on_since = t
            elif s.group(1) == server and "ran" in cur and "replied" not in cur:
                if on_since is not None:
                    cur["on"] += t - on_since
                on_since, off_since = None, t
                off_why = "R" if s.group(2).startswith("R") else "S"
                if off_why == "R":
                    preempted_by[s.group(3)] += 1
            elif s.group(3) == client and "replied" in cur:
                cur["client_ran"] = t
                rpcs.append(cur)
                cur = None
    if rpcs:
        parts = {
            "server wake-up latency": [r["ran"] - r["woken"] for r in rpcs],
            "server run to reply": [r["replied"] - r["ran"] for r in rpcs],
            "  of which preempted": [r["preempted"] for r in rpcs],
            "  of which blocked": [r["blocked"] for r in rpcs],
            "client wake-up latency": [r["client_ran"] - r["replied"] for r in rpcs],
        }
        print(f"round trips {client} -> {server} -> {client} ({len(rpcs)}):")
        print("  us                                  p50      p99    p99.9      max")
        for name, v in parts.items():
            v = [x * 1e6 for x in v]
            print(f"  {name:26s} {pct(v, .5):8.1f} {pct(v, .99):8.1f} {pct(v, .999):8.1f} "
                  f"{max(v):8.1f}")
        slow = [r for r in rpcs if r["client_ran"] - r["woken"] > 0.0008]

        def mean(key):
            return sum(r[key] for r in slow) / len(slow) * 1e6

        if slow:
            print(f"  the {len(slow)} slower than 0.8 ms: server preempted {mean('preempted'):.0f}"
                  f" us, blocked {mean('blocked'):.0f} us, on CPU {mean('on'):.0f} us on average")
        print("  the server thread was preempted by:",
              ", ".join(f"{who} {n}" for who, n in preempted_by.most_common(6)))

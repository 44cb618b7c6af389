#!/usr/bin/env python3
"""Reads a `perf record` of sched_switch/sched_wakeup/softirq_entry/softirq_exit (system-wide)
and prints: each thread's wake-up latency (wake-up to running), the softirq run durations, and
what ran on the CPU while the named threads waited more than 300 us for it.

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

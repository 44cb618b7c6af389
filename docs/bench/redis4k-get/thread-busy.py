# Per-thread busy time over a `perf script` of sched_switch events (sched-trace.sh), from the first
# time redis-server runs: prints the eight busiest threads. Usage: thread-busy.py TRACE.txt
import sys,re,collections
ev=re.compile(r'^\s*(\S.*?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)$')
cur={}; since={}; run=collections.Counter(); names={}
t0=t1=None
for line in open(sys.argv[1]):
    m=ev.match(line)
    if not m or m.group(5)!='sched:sched_switch': continue
    cpu=int(m.group(3)); t=float(m.group(4))
    s=re.search(r'prev_comm=(.*?) prev_pid=(\d+).*==> next_comm=(.*?) next_pid=(\d+)',m.group(6))
    pp=int(s.group(2)); np_=int(s.group(4)); names[np_]=s.group(3); names[pp]=s.group(1)
    if 'redis-server' in s.group(3) and t0 is None: t0=t
    if cpu in since and t0:
        run[pp]+=t-max(since[cpu],t0)
    since[cpu]=t; t1=t
span=t1-t0
print(f"span {span*1e3:.0f} ms")
for p,v in run.most_common(8): print(f"{names[p]:18s} {p:6d} {v*1e3:7.1f} ms {100*v/span:5.1f}%")

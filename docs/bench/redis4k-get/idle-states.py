# Idle CPU time by the state of the named threads when the CPU went idle (R running, W runnable,
# S sleeping). Usage: idle-states.py TRACE.txt PID=NAME...
import sys,re,collections
ev=re.compile(r'^\s*(\S.*?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)$')
watch={}  # pid->name
state={}  # pid -> 'R'(running) 'W'(runnable) or 'S'
for a in sys.argv[2:]:
    p,n=a.split('='); watch[int(p)]=n
idle_since={}; tally=collections.Counter(); t0=None
for line in open(sys.argv[1]):
    m=ev.match(line)
    if not m: continue
    cpu=int(m.group(3)); t=float(m.group(4)); name=m.group(5); rest=m.group(6)
    if name=='sched:sched_wakeup':
        w=re.search(r'pid=(\d+)',rest); p=int(w.group(1))
        if p in watch and state.get(p)!='R': state[p]='W'
        continue
    if name!='sched:sched_switch': continue
    s=re.search(r'prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)',rest)
    pp=int(s.group(1)); ps=s.group(2); np_=int(s.group(4))
    if pp in watch: state[pp]='W' if ps.startswith('R') else 'S'
    if np_ in watch: state[np_]='R'
    if t0 is None and np_ in watch: t0=t
    if np_==0: idle_since[cpu]=(t, tuple(state.get(p,'?') for p in watch))
    elif cpu in idle_since:
        st,snap=idle_since.pop(cpu); d=t-st
        if t0 and d>50e-6: tally[snap]+=d
print(' '.join(watch.values()))
for k,v in tally.most_common(12): print(f"{v*1e3:8.1f} ms  {' '.join(k)}")

"""Per-key callgrind counts by library (obj) or function (fn), sorted by one event:
by.py OUT KEYS obj|fn EVENT ROWS (events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw)."""
import sys,re,collections,subprocess
f=sys.argv[1]; keys=int(sys.argv[2]); mode=sys.argv[3]; sortk=sys.argv[4]; top=int(sys.argv[5])
txt=subprocess.run(['callgrind_annotate','--inclusive=no','--auto=no','--threshold=100','--show-percs=no',f],capture_output=True,text=True).stdout
ev=None; d=collections.defaultdict(lambda:[0]*9)
for l in txt.splitlines():
    if l.startswith('Events shown:'): ev=l.split()[2:]
    if 'PROGRAM TOTALS' in l: continue
    toks=l.split()
    if len(toks)<10 or not all(re.fullmatch(r'[\d,]+|\.',t) for t in toks[:9]): continue
    nums=[0 if t=='.' else int(t.replace(',','')) for t in toks[:9]]
    name=' '.join(toks[9:])
    o=re.search(r'\[([^\]]+)\]\s*$',name)
    if mode=='obj':
        k=o.group(1).split('/')[-1] if o else ('preload' if ('rustc' in name or 'netchannel' in name or 'deps' in name) else 'other')
    else:
        k=name
    for i,n in enumerate(nums): d[k][i]+=n
idx={e:i for i,e in enumerate(ev)}
rows=sorted(d.items(), key=lambda kv:-kv[1][idx[sortk]])
tot=[sum(v[i] for v in d.values()) for i in range(9)]
print('%-70s'%'what', ' '.join('%7s'%e for e in ev))
print('%-70s'%'TOTAL', ' '.join('%7.1f'%(x/keys) for x in tot))
for k,v in rows[:top]:
    print('%-70s'%k[-70:], ' '.join('%7.1f'%(x/keys) for x in v))

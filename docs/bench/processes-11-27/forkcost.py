import os, socket, sys, time
l = socket.create_server(("0.0.0.0", int(sys.argv[1])), backlog=4096)
n = int(sys.argv[2]); cs = []
while len(cs) < n:
    c, _ = l.accept(); cs.append(c)
ts = []
for _ in range(20):
    t = time.perf_counter(); pid = os.fork()
    if pid == 0: os._exit(0)
    os.waitpid(pid, 0); ts.append((time.perf_counter() - t) * 1000)
ts.sort(); print(f"fork+exit+wait with {n} connections: median {ts[10]:.2f} ms", flush=True)

import socket, sys, threading
host, port, n, par = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bad = [0]; lock = threading.Lock()
def work(k):
    for i in range(n):
        try:
            s = socket.create_connection((host, port), timeout=5)
            msg = b'x%d-%d' % (k, i)
            s.sendall(msg); got = b''
            while len(got) < len(msg):
                d = s.recv(100)
                if not d: break
                got += d
            if got != msg:
                with lock: bad[0] += 1; print('bad', k, i, got, flush=True)
            s.close()
        except Exception as e:
            with lock: bad[0] += 1; print('err', k, i, e, flush=True)
ts = [threading.Thread(target=work, args=(k,)) for k in range(par)]
[t.start() for t in ts]; [t.join() for t in ts]
print('bad', bad[0], 'of', n*par)

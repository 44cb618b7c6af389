import socket, sys, selectors
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
fails = 0
for i in range(n):
    try:
        s = socket.create_connection((host, port), timeout=20); socks.append(s)
    except Exception as e:
        fails += 1
        if fails < 4: print('connect', i, repr(e))
print('open', len(socks), flush=True)
for i, s in enumerate(socks): s.sendall(b'%08d' % i)
bad = 0
for i, s in enumerate(socks):
    got = b''
    while len(got) < 8:
        d = s.recv(8 - len(got))
        if not d: break
        got += d
    if got != b'%08d' % i: bad += 1
for s in socks: s.close()
print('failed', bad + fails, 'of', n)

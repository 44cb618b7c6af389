import socket, sys, time, threading
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
n = 0; t0 = time.time()
try:
    while time.time() - t0 < float(sys.argv[3]):
        c.sendall(b'x' * 1000); got = b''
        while len(got) < 1000:
            d = c.recv(1000 - len(got))
            if not d: raise EOFError('eof')
            got += d
        n += 1
    print('ok after', n, 'round trips')
except Exception as e:
    print('failed after %.1f s:' % (time.time() - t0), repr(e))

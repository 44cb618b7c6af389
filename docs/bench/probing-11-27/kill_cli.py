import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
s = [socket.create_connection((host, port)) for i in range(3)]
s[1].sendall(b'x')                  # read by server
s[2].sendall(b'y' * 10)             # never read by server: kernel sends RST at exit
time.sleep(1.0)
print('ready', flush=True)
time.sleep(2.0)                     # server killed meanwhile
for i, c in enumerate(s):
    try:
        out = []
        while True:
            d = c.recv(100)
            out.append(d)
            if not d: break
        print(i, 'recv', out)
    except Exception as e:
        print(i, 'recv error', type(e).__name__, e.errno)
    try:
        c.sendall(b'z'); time.sleep(0.2); c.sendall(b'z'); print(i, 'send ok')
    except Exception as e:
        print(i, 'send error', type(e).__name__, e.errno)

import socket, sys, time, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5602)); s.listen(8)
def chatter(c):
    try:
        while True: c.sendall(b"y" * 1000); time.sleep(0.0005)
    except Exception: pass
b, _ = s.accept(); threading.Thread(target=chatter, args=(b,), daemon=True).start()
a, _ = s.accept(); n = 0; time.sleep(float(sys.argv[1]))
try:
    while True:
        d = a.recv(1 << 16)
        if not d: break
        n += len(d)
    print("got", n, "eof")
except Exception as e:
    print("got", n, "error", e)

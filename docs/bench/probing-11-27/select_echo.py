import selectors, socket, sys
import signal; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
sel = selectors.DefaultSelector()
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], int(sys.argv[2]))); l.listen(512); l.setblocking(False)
sel.register(l, selectors.EVENT_READ)
while True:
    for k, _ in sel.select():
        if k.fileobj is l:
            try:
                while True:
                    c, _ = l.accept(); c.setblocking(False); sel.register(c, selectors.EVENT_READ)
            except BlockingIOError: pass
        else:
            c = k.fileobj
            try: d = c.recv(65536)
            except (BlockingIOError, ConnectionError): d = None if False else b''
            if d: c.sendall(d)
            else: sel.unregister(c); c.close()

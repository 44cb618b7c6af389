# A battery of TCP behaviours, printed so that kernel TCP and netchannel can be compared: run
# `probe.py server 10.214.0.2` in ncperf-b and `probe.py client 10.214.0.2` in ncperf-a, each
# under `netchannel run --` or not, and diff the clients' output (it writes /tmp/probe/f20).
import asyncio, hashlib, os, select, socket, struct, sys, threading, time, errno

BASE = 7600

def serve_forever(fn, port):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((HOST, port)); l.listen(512)
    def loop():
        while True:
            c, _ = l.accept()
            threading.Thread(target=fn, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()

def recv_exact(c, n):
    b = bytearray()
    while len(b) < n:
        x = c.recv(n - len(b))
        if not x: break
        b += x
    return bytes(b)

# 1: threaded echo of length-prefixed messages
def echo(c):
    while True:
        h = recv_exact(c, 4)
        if len(h) < 4: break
        n, = struct.unpack('!I', h)
        c.sendall(recv_exact(c, n))
    c.close()

# 2: sendfile of a 20 MB file, then close
def sendfile(c):
    with open(FILE, 'rb') as f:
        c.sendfile(f)
    c.close()

# 3: peek: send "hello world" then wait for "bye"
def peek(c):
    c.sendall(b'hello world'); recv_exact(c, 3); c.close()

# 4: rcvlowat: send 10 bytes, wait 0.3 s, send 90 more, wait for close
def lowat(c):
    c.sendall(b'a' * 10); time.sleep(0.3); c.sendall(b'b' * 90); c.recv(1); c.close()

# 5: reset after reading 1 byte with unread data left (close with unread -> RST)
def rst_unread(c):
    c.recv(1); time.sleep(0.2); c.close()

# 6: half close: read until EOF, then answer digest
def half(c):
    h = hashlib.sha256()
    while True:
        x = c.recv(65536)
        if not x: break
        h.update(x)
    c.sendall(h.hexdigest().encode()); c.close()

async def aecho(r, w):
    while True:
        x = await r.read(65536)
        if not x: break
        w.write(x); await w.drain()
    w.close()

def server():
    for i, fn in enumerate([echo, sendfile, peek, lowat, rst_unread, half]):
        serve_forever(fn, BASE + 1 + i)
    async def amain():
        s = await asyncio.start_server(aecho, HOST, BASE + 10)
        await s.serve_forever()
    asyncio.run(amain())

def client():
    out = []
    say = lambda *a: (print(*a, flush=True))
    # refused
    for nb in (False, True):
        s = socket.socket()
        if nb:
            s.setblocking(False)
            e = s.connect_ex((HOST, BASE + 99))
            select.select([], [s], [], 5)
            e2 = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            say('refused nonblocking:', errno.errorcode.get(e, e), errno.errorcode.get(e2, e2))
        else:
            try: s.connect((HOST, BASE + 99)); say('refused: connected?!')
            except OSError as ex: say('refused blocking:', errno.errorcode.get(ex.errno))
        s.close()
    # threaded echo, 100 threads x 50 messages of random size
    bad = [0]
    def worker(k):
        c = socket.create_connection((HOST, BASE + 1))
        for j in range(50):
            m = os.urandom((k * 7919 + j * 104729) % 70000 + 1)
            c.sendall(struct.pack('!I', len(m)) + m)
            if recv_exact(c, len(m)) != m: bad[0] += 1
        c.close()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(100)]
    t0 = time.time(); [t.start() for t in ts]; [t.join() for t in ts]
    say('threaded echo 100x50: bad', bad[0]); print(' (%.2f s)' % (time.time() - t0), file=sys.stderr)
    # sendfile
    c = socket.create_connection((HOST, BASE + 2)); h = hashlib.sha256(); n = 0
    while True:
        x = c.recv(1 << 20)
        if not x: break
        h.update(x); n += len(x)
    say('sendfile:', n, h.hexdigest() == hashlib.sha256(open(FILE, 'rb').read()).hexdigest())
    # peek
    c = socket.create_connection((HOST, BASE + 3)); time.sleep(0.2)
    a = c.recv(5, socket.MSG_PEEK); b = c.recv(100, socket.MSG_PEEK); d = c.recv(3); e = c.recv(100)
    try:
        f = c.recv(10, socket.MSG_DONTWAIT); say('dontwait got', f)
    except BlockingIOError: f = 'EAGAIN'
    say('peek:', a, b, d, e, f); c.sendall(b'bye'); c.close()
    # rcvlowat with poll
    c = socket.create_connection((HOST, BASE + 4)); c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 50)
    p = select.poll(); p.register(c, select.POLLIN)
    t0 = time.time(); r1 = p.poll(2000); dt = time.time() - t0
    x = c.recv(1000)
    say('rcvlowat 50: poll', r1 and r1[0][1], 'waited>=0.2s', dt >= 0.2, 'recv', len(x) >= 50)
    c.sendall(b'x'); c.close()
    # reset on unread data: send 1 MB, peer reads 1 byte and closes
    c = socket.create_connection((HOST, BASE + 5))
    try:
        for i in range(64): c.sendall(b'z' * 65536); time.sleep(0.01)
        say('rst_unread: no error in sends?')
    except OSError as ex: say('rst_unread send:', errno.errorcode.get(ex.errno))
    try: r = c.recv(10); say('rst_unread recv:', r)
    except OSError as ex: say('rst_unread recv:', errno.errorcode.get(ex.errno))
    say('rst_unread so_error after:', c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
    c.close()
    # half close
    c = socket.create_connection((HOST, BASE + 6)); data = os.urandom(5 << 20)
    c.sendall(data); c.shutdown(socket.SHUT_WR)
    try: c.sendall(b'x'); say('send after SHUT_WR worked?!')
    except OSError as ex: say('send after SHUT_WR:', errno.errorcode.get(ex.errno))
    say('half close digest ok:', c.recv(100).decode() == hashlib.sha256(data).hexdigest())
    c.close()
    # getsockname/getpeername, options
    c = socket.create_connection((HOST, BASE + 1))
    say('peername:', c.getpeername(), 'sockname host:', c.getsockname()[0])
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    say('nodelay:', c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
    try: c.send(b'!', socket.MSG_OOB); say('oob send ok')
    except OSError as ex: say('oob:', errno.errorcode.get(ex.errno))
    c.close()
    # asyncio echo: 50 clients x 2 MB
    async def one(k):
        r, w = await asyncio.open_connection(HOST, BASE + 10)
        data = os.urandom(2 << 20); got = bytearray()
        async def rd():
            while len(got) < len(data):
                x = await r.read(1 << 16)
                if not x: break
                got.extend(x)
        t = asyncio.create_task(rd())
        for i in range(0, len(data), 10000 + k):
            w.write(data[i:i + 10000 + k]); await w.drain()
        await t; w.close()
        return bytes(got) == data
    async def amain():
        return await asyncio.gather(*[one(k) for k in range(50)])
    res = asyncio.run(amain())
    say('asyncio 50x2MB all equal:', all(res))

HOST = sys.argv[2]; FILE = '/tmp/probe/f20'; os.makedirs('/tmp/probe', exist_ok=True)
if not os.path.exists(FILE):
    open(FILE, 'wb').write(os.urandom(20 << 20))
server() if sys.argv[1] == 'server' else client()

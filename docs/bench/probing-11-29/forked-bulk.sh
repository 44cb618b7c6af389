#!/usr/bin/env bash
# A forking server (Python: accept, fork, the child writes 400 MB and exits; the parent closes
# its copy) and a client that reads it all, between the ncperf namespaces, both under DIR's
# `netchannel run` (or kernel TCP with `linux`); prints the time and MB/s. Then the same with
# 2,000 request/answer round trips of 100 bytes in the forked child. Usage: forked-bulk.sh linux|DIR
dir=$1; wrap=(); [[ $dir != linux ]] && wrap=("$dir/netchannel" run ${STATS:+--stats-file $STATS} --)
cat > /tmp/fb-server.py <<'PY'
import os, socket, sys, signal
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.214.0.2", 7100)); s.listen(8)
for _ in range(2):
    c, _ = s.accept()
    if os.fork() == 0:
        s.close()
        mode = c.recv(1)
        if mode == b"b":
            buf = b"x" * 65536
            for _ in range(400 * 1000000 // 65536): c.sendall(buf)
        else:
            f = c.makefile("rb")
            for _ in range(2000):
                c.sendall(f.read(100))
        c.close(); os._exit(0)
    c.close()
os.wait(); os.wait()  # the owner outlives its children (see ARCHITECTURE, Limits)
PY
cat > /tmp/fb-client.py <<'PY'
import socket, time, sys
c = socket.create_connection(("10.214.0.2", 7100)); c.sendall(b"b"); n = 0; t = time.time()
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
dt = time.time() - t
print("bulk %d bytes in %.2f s, %.0f MB/s" % (n, dt, n / dt / 1e6))
c = socket.create_connection(("10.214.0.2", 7100)); c.sendall(b"r"); t = time.time()
for _ in range(2000):
    c.sendall(b"q" * 100); got = 0
    while got < 100: got += len(c.recv(100 - got))
dt = time.time() - t
print("2000 round trips in %.2f s, %.0f us each" % (dt, dt / 2000 * 1e6))
PY
ip netns exec ncperf-b "${wrap[@]}" python3 /tmp/fb-server.py & s=$!
sleep 1
ip netns exec ncperf-a "${wrap[@]}" python3 /tmp/fb-client.py | sed "s|^|$dir |"
wait $s

import socket, sys, time, signal
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], int(sys.argv[2]))); l.listen(16)
conns = []
for i in range(3):
    c, _ = l.accept(); conns.append(c)
conns[0].sendall(b'hello')          # conn 0: data then nothing (server killed with nothing unread)
d = conns[1].recv(100)              # conn 1: read its data
time.sleep(100)

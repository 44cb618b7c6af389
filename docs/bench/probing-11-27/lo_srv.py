import socket, sys
l = socket.create_server(('127.0.0.1', int(sys.argv[1])))
while True:
    c, a = l.accept(); c.sendall(b'secret from localhost-only server, you are %r\n' % (a,)); c.close()

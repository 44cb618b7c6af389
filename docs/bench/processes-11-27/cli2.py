import socket, sys, os, time
b = socket.create_connection(("10.214.0.2", 5602))
time.sleep(0.05)
a = socket.create_connection(("10.214.0.2", 5602))
a.sendall(b"x" * int(sys.argv[1]))
if sys.argv[2] == "close": a.close()
os._exit(0)

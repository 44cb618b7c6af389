import socket, sys, time
cs = [socket.create_connection(("10.214.0.2", int(sys.argv[1]))) for _ in range(int(sys.argv[2]))]
time.sleep(float(sys.argv[3]))

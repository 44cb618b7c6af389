#!/usr/bin/env python3
"""Where a redis thread's samples went, per 1,000 GETs: buckets.py [--client] OUT.txt OUT.rate ...
(profile.sh's output, its `server` or `client` side; 0.6 s sampled at 999 Hz). A sample counts
in the first bucket whose frame it holds."""
import collections, re, sys

SERVER = [
    ("kernel: sendmsg (replies out)", ("tcp_sendmsg",)),
    ("kernel: recvmsg (requests in)", ("tcp_recvmsg", "Channel::read")),
    ("library: writev outside the system call", ("interpose::writev",)),
    ("library: read/recv outside the system call", ("interpose::read", "interpose::recv")),
    ("waits: epoll_wait", ("epoll_wait", "do_epoll")),
    ("redis: reading and running commands", ("readQueryFromClient",)),
]
CLIENT = [
    ("kernel: epoll_ctl", ("do_epoll_ctl",)),
    ("library: epoll_ctl", ("interpose::epoll_ctl",)),
    ("kernel: sendmsg (requests out)", ("tcp_sendmsg",)),
    ("kernel: recvmsg (replies in)", ("tcp_recvmsg",)),
    ("library: read from the staged replies", ("Carried::recv",)),
    ("library: epoll_wait (its own work)", ("waits::epoll_wait",)),
    ("kernel: epoll_wait", ("do_epoll_wait",)),
    ("hiredis: reply parsing", ("redisReaderGetReply",)),
    ("redis-benchmark: the rest", ("redis",)),
]

args = sys.argv[1:]
buckets = SERVER
if args and args[0] == "--client":
    buckets, args = CLIENT, args[1:]
for txt, rate in zip(args[::2], args[1::2]):
    gets = float(re.search(r"GET: ([0-9.]+)", open(rate).read()).group(1))
    counts, total = collections.Counter(), 0
    for sample in open(txt).read().split("\n\n"):
        frames = "\n".join(l.strip() for l in sample.strip().split("\n")[1:])
        if not frames:
            continue
        total += 1
        name = next((n for n, keys in buckets if any(k in frames for k in keys)), "other")
        counts[name] += 1
    per_k = lambda n: n / (0.6 * gets / 1000)
    print(f"{txt}: {gets:,.0f} GETs/s, {total} samples, {per_k(total):.2f} per 1,000 GETs")
    for name, _ in buckets + [("other", ())]:
        print(f"  {name:45s} {per_k(counts[name]):.2f}")

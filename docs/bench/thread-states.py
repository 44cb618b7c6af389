#!/usr/bin/env python3
"""Off-CPU view without perf: samples every thread of the ncperf client and server
processes (/proc/PID/task/*: comm, state, current system call, wchan) for SECONDS and
prints how often each (process, thread name, state, syscall, wchan) was seen.
Usage: thread-states.py SECONDS [INTERVAL_S]"""
import collections, glob, os, sys, time

SYSCALLS = {"0": "read", "1": "write", "7": "poll", "19": "readv", "20": "writev",
            "23": "select", "35": "nanosleep", "202": "futex", "232": "epoll_wait",
            "233": "epoll_ctl", "281": "epoll_pwait", "441": "epoll_pwait2",
            "44": "sendto", "45": "recvfrom", "46": "sendmsg", "47": "recvmsg"}

def procs():
    for d in glob.glob("/proc/[0-9]*"):
        try:
            args = open(d + "/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"ncperf") for a in args[:1]) and len(args) > 1 and args[1] in (b"server", b"client"):
            yield args[1].decode(), d

def main():
    seconds = float(sys.argv[1]); interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.005
    counts = collections.Counter(); rounds = 0
    end = time.time() + seconds
    while time.time() < end:
        rounds += 1
        for role, d in procs():
            for t in glob.glob(d + "/task/*"):
                try:
                    comm = open(t + "/comm").read().strip().rstrip("0123456789")
                    state = open(t + "/stat").read().rsplit(")", 1)[1].split()[0]
                    sc = open(t + "/syscall").read().split()[0]
                    wchan = open(t + "/wchan").read().strip() or "-"
                except OSError:
                    continue
                sc = "on-cpu" if sc == "running" else SYSCALLS.get(sc, "sys" + sc)
                counts[(role, comm, state, sc if state != "R" else "-", wchan if state != "R" else "-")] += 1
        time.sleep(interval)
    print(f"# {rounds} rounds; share of samples of each thread group (count / rounds = threads in that state on average)")
    for (role, comm, state, sc, wchan), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[1])):
        print(f"{role:6} {comm:14} {state} {sc:12} {wchan:28} {n / rounds:6.2f}")

main()

#!/usr/bin/env python3
"""CPU per key by thread and by system call (the outermost kernel frame), from `perf script -F
comm,ip,sym` of profile.sh's OUT.data. Usage: per-key.py SCRIPT.txt KEYS_PER_SECOND"""
import collections
import sys

THREADS = ("mc-worker", "memcslap", "nc-worker-0", "nc-worker-1")
ENTRY = ("entry_SYSCALL", "do_syscall_64", "asm_", "irqentry", "ret_from_fork", "x64_sys_call")


def main(path, keys_per_second):
    seconds, hz = 2, 999
    keys = keys_per_second * seconds
    counts = collections.Counter()
    for block in open(path).read().split("\n\n"):
        lines = [l for l in block.strip().split("\n") if l.strip()]
        if not lines or lines[0].split()[0] not in THREADS:
            continue
        frames = [(l.split(None, 1) + ["?"])[:2] for l in (x.strip() for x in lines[1:])]
        kernel = [sym for addr, sym in frames if addr.startswith("ffffffff")]
        if not kernel:
            lib = any("netchannel" in sym for _, sym in frames)
            key = "(user) " + ("library" if lib else "other")
        else:
            key = next((s for s in reversed(kernel) if not s.startswith(ENTRY)), "?")
        counts[(lines[0].split()[0], key)] += 1
    for (thread, key), n in counts.most_common(24):
        print(f"  {thread:<12} {key[:40]:<40} {n / hz / keys * 1e6:5.2f} us/key")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))

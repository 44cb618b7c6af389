#!/usr/bin/env bash
# The table of docs/BENCHMARKS.md "A slow memcpy": glibc's memcpy of 64 KiB (and 4 KiB) by
# the destination's distance above the source modulo a page, in one call and in 2 KiB pieces.
set -euo pipefail
cd "$(dirname "$0")"
gcc -O2 -o /tmp/alias alias.c
grep -m1 "model name" /proc/cpuinfo; ldd --version | head -1
for d in 0 1 16 32 48 63 64 200 4080; do /tmp/alias 65536 20000 $d; done
for d in 0 16; do /tmp/alias 65536 20000 $d 2048; /tmp/alias 4096 200000 $d; done

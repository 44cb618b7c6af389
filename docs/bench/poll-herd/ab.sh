#!/usr/bin/env bash
# Interleaved A/B of two builds of the interposition library: before and after poll/select over
# carried fds sleep in the thread's own epoll set (the programs that wait in poll or select).
# Usage: docs/bench/poll-herd/ab.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
here="$(dirname "$0")"
"$here/../programs-ab.sh" "$1" "$2" "${3:-3}" docs/bench/poll-herd memcached,iperf3,sockperf 1

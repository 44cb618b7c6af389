#!/usr/bin/env bash
# Interleaved A/B of two builds of the interposition library: before and after an epoll_wait
# over carried fds first reads what the channels hold (the event-loop programs).
# Usage: docs/bench/serve-first/ab.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
here="$(dirname "$0")"
"$here/../programs-ab.sh" "$1" "$2" "${3:-3}" docs/bench/serve-first \
  redis16,redis4k,memcached,sockperf 1

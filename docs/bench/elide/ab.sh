#!/usr/bin/env bash
# Interleaved A/B of two builds of the interposition library: before and after elided readiness.
# Usage: docs/bench/elide/ab.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
here="$(dirname "$0")"
"$here/../programs-ab.sh" "$1" "$2" "${3:-2}" docs/bench/elide \
  redis16,redis4k,memcached,iperf3,sockperf 0.5

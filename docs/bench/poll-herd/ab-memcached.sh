#!/usr/bin/env bash
# memcached alone (set and get, with the get figure parsed right: commit 6db8e02), interleaved
# between two builds of the interposition library. Usage: ab-memcached.sh OLD_DIR NEW_DIR ROUNDS
set -euo pipefail
here="$(dirname "$0")"
"$here/../programs-ab.sh" "$1" "$2" "${3:-3}" docs/bench/poll-herd memcached 1 memcached-

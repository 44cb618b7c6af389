#!/usr/bin/env bash
# redis4k GET under netchannel with the throughput channels' TCP_NOTSENT_LOWAT at its default
# (1 MiB) and at 128 KiB (NETCHANNEL_NOTSENT_LOWAT), interleaved: the server's retransmitted
# segments and GET/s. Usage: lowat.sh [NETCHANNEL] [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../../.."
nc=${1:-target/release/netchannel}; rounds=${2:-3}
for r in $(seq 1 "$rounds"); do
  for lowat in 1048576 131072; do
    echo -n "notsent_lowat $lowat: "
    NETCHANNEL_NOTSENT_LOWAT=$lowat docs/bench/redis4k-get/reorder.sh "$nc" 0 netchannel-only
  done
done

#!/bin/bash
# sockperf ping-pong (64 B, 6 s) between the ncperf namespaces, interleaved: kernel TCP
# (`linux`) and, for each other variant N, both ends under `netchannel run --stats` with
# NC_SCRATCH_POLL_RULE=N (the scratch build of scratch.diff; the default build ignores it).
# Usage: run.sh ROUNDS VARIANT... (e.g. run.sh 4 linux 0 3 2). One line per run: sockperf's
# percentiles (half round trips, us) and the client's poll counts.
NC=${NC:-target/release/netchannel}; rounds=$1; shift; tmp=$(mktemp -d)
for round in $(seq 1 "$rounds"); do for v in "$@"; do
  if [ "$v" = linux ]; then w=(); else w=(env NC_SCRATCH_POLL_RULE="$v" "$NC" run --stats --); fi
  ip netns exec ncperf-b "${w[@]}" sockperf server -i 10.214.0.2 -p 11116 --tcp >"$tmp/srv" 2>&1 & srv=$!
  sleep 1
  ip netns exec ncperf-a "${w[@]}" sockperf ping-pong -i 10.214.0.2 -p 11116 --tcp -t 6 -m 64 >"$tmp/cli" 2>&1
  kill $srv; wait $srv 2>/dev/null; sleep 0.5
  echo "$v: $(grep -oE 'percentile (50|75|90|99|99.900)\.[0-9]+ = +[0-9.]+' "$tmp/cli" | awk '{print $2"="$4}' | tr '\n' ' ') $(grep -o 'polled before.*' "$tmp/cli")"
done; done
rm -r "$tmp"

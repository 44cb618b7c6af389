#!/usr/bin/env bash
# min_stream_window 16 KiB (old default) against 64 KiB: issue 18's rows, interleaved.
# Usage: docs/bench/stream-floor/ab.sh OLD_NCPERF NEW_NCPERF ROUNDS OUT
# Summary: docs/bench/ab-summary.py OUT goodput_gbps gbps_per_core rps latency_us.p99 latency_us.p999
here=$(dirname "$0")
exec bash "$here/../ncperf-ab.sh" "$1" "$2" "$3" "$4" \
 'flows10k --workload stream --pattern one-to-one --flows 10000 --size 4096' \
 'rpc1000 --workload rr --pattern one-to-one --flows 1000 --size 4096' \
 'incast64 --workload stream --pattern incast --flows 64 --size 65536' \
 'a2a64 --workload stream --pattern all-to-all --flows 64 --size 65536' \
 'mixed --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536' \
 't8 --workload stream --pattern one-to-one --flows 8 --size 65536' \
 'stream1m --workload stream --size 1048576' \
 'rr1 --workload rr --size 4096'

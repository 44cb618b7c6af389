#!/usr/bin/env bash
# Many peers (issue 18): one server engine, N client engines (each a host of its own address),
# 1,000 flows of 4 KiB RPCs in all, at a fixed 5 RPC/s per flow (the server's cost per RPC at
# one load) and closed-loop (as fast as they go); Linux beside each with 1,000 connections.
# Usage: docs/bench/peers/run.sh   (writes docs/bench/peers/*.json)
set -euo pipefail
n=target/release/ncperf
out=docs/bench/peers
common=(--workload rr --size 4096 --pattern one-to-one --flows 1000 --duration 4 --json)
for rep in 1 2 3; do
  $n run --stack linux "${common[@]}" --rate 5 > $out/rate-linux-$rep.json
  for peers in 1 100 1000; do
    $n run --stack netchannel "${common[@]}" --rate 5 --peers $peers --max-sessions 4096 \
      > $out/rate-peers$peers-$rep.json
  done
done
for rep in 1 2 3; do
  $n run --stack linux "${common[@]}" > $out/closed-linux-$rep.json
  for peers in 1 1000; do
    $n run --stack netchannel "${common[@]}" --peers $peers --max-sessions 4096 \
      > $out/closed-peers$peers-$rep.json
  done
done

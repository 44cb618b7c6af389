#!/usr/bin/env bash
# Profile-guided build of netchannel: the launcher and interposition library
# (target/pgo/release/netchannel, libnetchannel_preload.so) and ncperf (target/pgo/release/ncperf).
#
# Why: the per-message path is long and runs once per message, so it is bound by instruction
# fetch (docs/BENCHMARKS.md, "where memcached's user time goes"); laid out by a profile of real
# traffic, the hot code is packed together and the cold code moved aside. docs/BENCHMARKS.md,
# "A profile-guided build", has the A/B.
#
# How: an instrumented build (target/pgo-gen) runs the training workloads between the ncperf
# namespaces (the programs of `ncperf programs` at a third of their size, and ncperf's own
# workloads through the Rust API, about three minutes), llvm-profdata (rustup's llvm-tools, added
# if missing) merges what they wrote, and the final build uses it. The profile is made afresh
# from the code being built: nothing goes stale. Needs root (namespaces) and the programs
# `scripts/setup.sh` installs. Usage: scripts/pgo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rustup component add llvm-tools >/dev/null 2>&1 || true
profdata=$(find "$(rustc --print sysroot)/lib/rustlib" -name llvm-profdata -type f | head -n1)
if [[ -z $profdata ]]; then
  echo "pgo.sh: llvm-profdata not found (rustup component add llvm-tools)" >&2
  exit 1
fi
raw=$PWD/target/pgo-profiles
rm -rf "$raw" && mkdir -p "$raw/programs" "$raw/api"
echo "pgo.sh: instrumented build (target/pgo-gen)"
RUSTFLAGS="-Cprofile-generate=$raw" CARGO_TARGET_DIR=target/pgo-gen \
  cargo build --release --quiet -p netchannel -p netchannel-preload -p ncperf
gen=target/pgo-gen/release
"$gen/ncperf" testbed up >/dev/null

# Each artifact learns from its own workloads: the library from the programs, ncperf from the
# Rust API's. (The engine's code is in both; one profile of both would rate the programs' small
# messages against the Rust API's bulk streams, and lay the library out for the latter.)
echo "pgo.sh: training (programs, then the Rust API's workloads)"
LLVM_PROFILE_FILE="$raw/programs/%m.profraw" "$gen/ncperf" programs --netchannel "$gen/netchannel" \
  --only redis16,redis4k,memcached,sockperf,iperf3 --repetitions 1 --scale 0.3 \
  >"$raw/programs.txt" 2>&1
train() {
  LLVM_PROFILE_FILE="$raw/api/%m.profraw" "$gen/ncperf" run --stack netchannel --duration "$@" \
    >>"$raw/runs.txt" 2>&1
}
for size in 64 4096 16384 65536 1048576; do train 3 --workload stream --size "$size"; done
train 1 --workload rr --size 4096
train 1 --workload rr --size 4096 --pattern one-to-one --flows 1000
train 1 --workload stream --pattern one-to-one --flows 10000 --size 4096
train 2 --workload stream --pattern incast --flows 64
train 2 --workload stream --pattern all-to-all --flows 64
train 1 --workload mixed --latency-flows 1 --throughput-flows 8 --size 65536

# The same packages as the instrumented build in both: a crate's symbols (which the profile
# names) depend on the features the build unifies.
build() {
  local profile=$1 dir=$2
  "$profdata" merge -o "$raw/$profile.profdata" "$raw/$profile"/*.profraw
  RUSTFLAGS="-Cprofile-use=$raw/$profile.profdata -Cllvm-args=-no-pgo-warn-mismatch" \
    CARGO_TARGET_DIR=$dir cargo build --release --quiet -p netchannel -p netchannel-preload -p ncperf
}
echo "pgo.sh: final builds (target/pgo: the library and launcher; target/pgo-api: ncperf)"
build programs target/pgo
build api target/pgo-api
# Beside the launcher, so that its `ncperf programs` runs this build's library by default.
cp target/pgo-api/release/ncperf target/pgo/release/ncperf
echo "pgo.sh: built target/pgo/release/{netchannel,libnetchannel_preload.so,ncperf}"

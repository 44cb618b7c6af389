#!/usr/bin/env bash
# Builds and runs the demo: two engines, one virtual socket over 4 channels, goodput and
# latency next to a plain kernel TCP socket measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --release --quiet --bin nc-demo
exec ./target/release/nc-demo "$@"

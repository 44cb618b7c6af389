#!/usr/bin/env bash
# Runs every check CI runs: formatting, lints, and all tests (namespace tests need root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo fmt --all --check
cargo clippy --all-targets --quiet -- -D warnings
cargo test --all-targets
cargo test --doc --quiet

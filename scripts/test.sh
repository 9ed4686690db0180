#!/usr/bin/env bash
# Every test of the project, as CI runs it (`.ci/run` calls this script): formatting, lints,
# then the Rust unit, property and cross-process tests. Works on a machine with no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --workspace --all-targets --release -- -D warnings

echo "== cargo test (release: the cross-process tests move megabytes between 8 ranks)"
cargo test --workspace --release

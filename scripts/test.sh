#!/usr/bin/env bash
# The test command: fetch the assets the tests need (idempotent, sha256-checked), check the
# formatting and the lints, build and run every test of the workspace. Works on a fresh clone;
# reuses ~/.cache/dflash-rs and target/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh all
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --release --workspace --no-fail-fast "$@"
else
  cargo test --release --workspace --no-fail-fast "$@"
fi

#!/usr/bin/env bash
# The main job on the embedded default: fetch SmolLM2-135M-Instruct, build, and generate.
# Extra arguments go to `dflash-rs generate` (e.g. --prompt "..." --max-new-tokens 64 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh smollm2 >&2
cargo build --release --quiet -p dflash-cli
if [ $# -eq 0 ]; then
  set -- --prompt "Explain in two sentences why the sky is blue." --chat --max-new-tokens 64
fi
exec "${CARGO_TARGET_DIR:-target}/release/dflash-rs" generate --target smollm2-135m "$@"

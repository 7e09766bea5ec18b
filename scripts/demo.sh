#!/usr/bin/env bash
# The main job on the embedded default: fetch SmolLM2-135M-Instruct, build, and generate —
# by default with speculative decoding (the bundled drafter, DDTree with a budget of 8 nodes:
# the fastest mode on the CPU; `--mode dflash` for the chain) beside plain AR, printing the
# text, τ and the speed-up over AR, and checking that both outputs are equal.
# Extra arguments replace the default ones and go to `dflash-rs generate` (e.g. --prompt "..."
# --chat --max-new-tokens 64 --json; without --mode it decodes AR only).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh smollm2 >&2
cargo build --release --quiet -p dflash-cli
if [ $# -eq 0 ]; then
  set -- --mode ddtree --budget 8 --compare-ar --prompt "Explain in two sentences why the sky is blue." \
    --chat --max-new-tokens 64
fi
exec "${CARGO_TARGET_DIR:-target}/release/dflash-rs" generate --target smollm2-135m "$@"

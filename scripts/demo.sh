#!/usr/bin/env bash
# The main command: fetch SmolLM2-135M-Instruct, build, and generate with speculative decoding
# (the bundled drafter, `--mode auto`: each round the DDTree budget, or an AR step, with the
# most expected tokens for its measured cost) beside plain AR, on a grade-school math question
# (the drafter's best domain), printing the text, τ and the speed-up over AR, and checking that
# both outputs are equal.
# Extra arguments replace the default ones and go to `dflash-rs generate` (e.g. --prompt "..."
# --chat --max-new-tokens 64 --json; --mode ar for AR only, --mode ddtree:4 or dflash for a
# fixed mode).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh smollm2 >&2
cargo build --release --quiet -p dflash-cli
if [ $# -eq 0 ]; then
  set -- --compare-ar --chat --max-new-tokens 128 --prompt \
    "A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 of them. How many muffins are left?"
fi
exec "${CARGO_TARGET_DIR:-target}/release/dflash-rs" generate --target smollm2-135m "$@"

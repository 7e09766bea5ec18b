#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp source vendored in the llama-cpp-python
# sdist (pinned), with cmake and ninja from PyPI, and cache the binary: the reference server of
# bench/serve_side_by_side.sh. Prints the binary's path. Idempotent.
#
#   scripts/build-llama-server.sh            # → $DFLASH_HOME/llama.cpp-0.3.36/bin/llama-server
set -euo pipefail
VERSION=0.3.36
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
PY=${PYTHON:-python3}
DEST=$HOME_DIR/llama.cpp-$VERSION
BIN=$DEST/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# the sdist itself, by PyPI's JSON API and its sha256 there (pip would build its build
# dependencies from source just to read its metadata)
mkdir -p "$WORK/sdist"
"$PY" - "$VERSION" "$WORK/sdist" <<'PYEOF' >&2
import hashlib, json, sys, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama_cpp_python/json"
meta = json.load(urllib.request.urlopen(index))
sdist = next(u for u in meta["releases"][version] if u["packagetype"] == "sdist")
data = urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"])).read()
assert hashlib.sha256(data).hexdigest() == sdist["digests"]["sha256"], "sha256 mismatch"
open(f"{dest}/{sdist['filename']}", "wb").write(data)
print("fetched", sdist["filename"], sdist["digests"]["sha256"])
PYEOF
"$PY" -m pip install -q --disable-pip-version-check --only-binary :all: --target "$WORK/tools" cmake ninja >&2
export PATH=$WORK/tools/bin:$PATH
tar -xzf "$WORK"/sdist/llama_cpp_python-$VERSION.tar.gz -C "$WORK"
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp
PYTHONPATH=$WORK/tools cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >&2
PYTHONPATH=$WORK/tools cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$DEST.partial/bin"
cp "$WORK/build/bin/llama-server" "$DEST.partial/bin/"
rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
echo "$BIN"

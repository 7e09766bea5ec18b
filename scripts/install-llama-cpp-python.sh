#!/usr/bin/env bash
# Install llama-cpp-python 0.3.36 with its server extras (built from its sdist by pip: the
# llama.cpp it vendors, compiled for this CPU) into a cached virtual environment: the second
# reference server of bench/serve_side_by_side.sh. Prints the environment's python. Idempotent.
#
#   scripts/install-llama-cpp-python.sh      # → $DFLASH_HOME/py/llama-cpp-python-0.3.36/bin/python
set -euo pipefail
VERSION=0.3.36
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
ENV=$HOME_DIR/py/llama-cpp-python-$VERSION
if [ -x "$ENV/bin/python" ] && "$ENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
  echo "$ENV/bin/python"; exit 0
fi
rm -rf "$ENV.partial"
python3 -m venv "$ENV.partial"
"$ENV.partial/bin/python" -m pip install -q --disable-pip-version-check "llama-cpp-python[server]==$VERSION" >&2
rm -rf "$ENV" && mv "$ENV.partial" "$ENV"
# a venv's scripts name its path: rewrite them for the final one
grep -rl "$ENV.partial" "$ENV/bin" 2>/dev/null | xargs -r sed -i "s|$ENV.partial|$ENV|g"
echo "$ENV/bin/python"

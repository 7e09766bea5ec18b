#!/usr/bin/env bash
# Build dflash-rs with CUDA on a machine without a GPU or a system CUDA toolkit.
#
# 1. installs the CUDA 13.0 build toolchain from PyPI into $DFLASH_HOME/cuda-13.0 (nvcc must be
#    13.0.x: the device's driver 580 = CUDA 13.0 rejects PTX from a newer nvcc);
# 2. adds unversioned .so links (the wheels ship only .so.13 / .so.10 / .so.2) and a link-time
#    stub libcuda.so (soname libcuda.so.1) made from the driver symbols cudarc declares — the
#    stub is never shipped: at run time the real driver is loaded;
# 3. builds `--features cuda` for compute capability 9.0 (H100/H200) into target/ (or
#    $CARGO_TARGET_DIR), cold in about 7–10 minutes on 2 cores.
#
# Usage: scripts/cuda-build.sh [extra cargo build args]   → target/cuda/release/dflash-rs (CUDA)
# On the device: LD_LIBRARY_PATH must hold torch's venv nvidia/cu13/lib and nvidia/nccl/lib
# (see docs/GPU.md); the first run JIT-compiles PTX (about 20 s).
set -euo pipefail
cd "$(dirname "$0")/.."
HOME_DIR=${DFLASH_HOME:-$HOME/.cache/dflash-rs}
CUDA_DIR=$HOME_DIR/cuda-13.0
SITE=$CUDA_DIR/site
PKGS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85
nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
nvidia-nccl-cu13==2.28.9"
stamp=$CUDA_DIR/.installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$(echo $PKGS)" ]; then
  echo "[cuda-build] installing the CUDA 13.0 toolchain into $CUDA_DIR" >&2
  rm -rf "$SITE.partial"
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --disable-pip-version-check --target "$SITE.partial" $PKGS
  rm -rf "$SITE" && mv "$SITE.partial" "$SITE"
  echo $PKGS > "$stamp"
fi
CU=$SITE/nvidia/cu13
NCCL=$SITE/nvidia/nccl
"$CU/bin/nvcc" --version | grep -q "release 13.0" || { echo "nvcc is not 13.0" >&2; exit 1; }

# unversioned links for the linker
link() { [ -e "$1/$2" ] || ln -sf "$(basename "$(ls "$1/$2".* | head -n 1)")" "$1/$2"; }
for l in libcudart.so libnvrtc.so libcublas.so libcublasLt.so libcurand.so; do link "$CU/lib" "$l"; done
link "$NCCL/lib" libnccl.so
ln -sf "$NCCL/lib/libnccl.so" "$CU/lib/libnccl.so"

# the link-time driver stub
mkdir -p "$CU/lib/stubs"
if [ ! -f "$CU/lib/stubs/libcuda.so" ]; then
  # on a fresh machine the registry is empty until `cargo fetch` (the glob then matches nothing)
  find_cudarc() { ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10 2>/dev/null | head -n 1 || true; }
  cudarc=$(find_cudarc)
  [ -n "$cudarc" ] || { cargo fetch >/dev/null; cudarc=$(find_cudarc); }
  [ -n "$cudarc" ] || { echo "[cuda-build] cudarc 0.19.10 not found in the cargo registry after cargo fetch" >&2; exit 1; }
  grep -rhoE "pub (unsafe )?fn cu[A-Z][A-Za-z0-9_]*" "$cudarc/src/driver" | sed -E 's/.* fn //' | sort -u \
    | awk '{print "void " $1 "(void) {}"}' > "$CUDA_DIR/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$CUDA_DIR/libcuda_stub.c"
fi

export CUDA_PATH=$CU CUDA_ROOT=$CU CUDA_HOME=$CU
export PATH=$CU/bin:$CU/nvvm/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$CU/lib:$CU/lib/stubs:$NCCL/lib:${LIBRARY_PATH:-}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
cargo build --release -p dflash-cli --features cuda "$@"
echo "[cuda-build] built $CARGO_TARGET_DIR/release/dflash-rs (CUDA, sm_$CUDA_COMPUTE_CAP)" >&2

//! With the `cuda` feature: compiles `src/cuda/fused.cu` to PTX (`$OUT_DIR/fused.ptx`) with
//! the `nvcc` on `PATH` (scripts/cuda-build.sh puts the CUDA 13.0 toolchain there), for compute
//! capability `$CUDA_COMPUTE_CAP` (default 90, the H100/H200). Without it: nothing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/cuda/fused.cu");
    println!("cargo:rerun-if-changed=src/cuda/mma_attn.cuh");
    println!("cargo:rerun-if-changed=src/cuda/train_attn.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("fused.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("src/cuda/fused.cu")
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| {
            panic!("the cuda feature needs nvcc ({nvcc}) to compile src/cuda/fused.cu: {e}")
        });
    if !status.success() {
        panic!("nvcc failed on src/cuda/fused.cu ({status})");
    }
}

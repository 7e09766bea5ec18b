//! With the `cuda` feature: compiles `src/cuda/kernels.cu`, the one unit that includes every
//! kernel family (`src/ops/*.cu` and the like, each beside the Rust module that launches it), to
//! one PTX module (`$OUT_DIR/kernels.ptx`) with the `nvcc` on `PATH` (scripts/cuda-build.sh puts
//! the CUDA 13.0 toolchain there), for compute capability `$CUDA_COMPUTE_CAP` (default 90, the
//! H100/H200). Without it: nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

const UNIT: &str = "src/cuda/kernels.cu";

/// Every `.cu` and `.cuh` file under `dir`, recursively: the unit and all it may include.
fn cuda_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            cuda_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "cu" || x == "cuh") {
            out.push(p);
        }
    }
}

fn main() {
    let mut sources = Vec::new();
    cuda_sources(Path::new("src"), &mut sources);
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg(UNIT)
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("the cuda feature needs nvcc ({nvcc}) to compile {UNIT}: {e}"));
    if !status.success() {
        panic!("nvcc failed on {UNIT} ({status})");
    }
}

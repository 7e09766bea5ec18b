//! The GPU side: our CUDA kernels (`kernels.cu`, the unit that gathers each family's source from
//! beside the module of `crate::ops` that launches it; PTX built by `build.rs` with the `cuda`
//! feature), their check against the CPU twins, forwards replayed from CUDA graphs, and where a
//! forward's time goes.

pub mod graphed;
pub mod graphed_draft;
pub mod kernel_check;
pub mod launch_profile;
#[cfg(feature = "cuda")]
pub(crate) mod ptx;

//! dflash-rs's own CUDA kernels (`src/cuda/kernels.cu`, the unit that includes each family's
//! source, compiled to one PTX module by `build.rs`): training (the drafter's block softmax, the
//! fused cross-entropy, RMSNorm and SwiGLU backwards, AdamW), the target's attention (interval,
//! decode and prefill kernels), sampling, the decode layer's fused kernels and the Gated DeltaNet
//! rule. Each is launched by the Rust module that holds its CPU twin (`crate::ops::*`), whose
//! CUDA source sits beside it (`src/ops/gemv.cu` beside `src/ops/gemv.rs`); loaded once per
//! device through candle's custom-module cache.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};

pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
pub const MODULE: &str = "dflash_train";

/// The kernel name `{name}_{f32|bf16}` for `dtype`.
pub fn kernel(name: &str, dtype: DType) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        other => candle_core::bail!("{name}: no CUDA kernel for {other:?} (f32 and bf16 only)"),
    };
    Ok(format!("{name}_{suffix}"))
}

/// Launch kernel `$name` (for `$dtype`) on `$dev` with `$cfg` and the arguments, in order.
/// Example: `launch!(dev, "ce_fwd", DType::BF16, rows(n, 256), x, labels, out, v)`.
macro_rules! launch {
    ($dev:expr, $name:expr, $dtype:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let f = $dev.get_or_load_custom_func(
            &$crate::cuda::ptx::kernel($name, $dtype)?,
            $crate::cuda::ptx::MODULE,
            $crate::cuda::ptx::PTX,
        )?;
        // more than 48 KiB of dynamic shared memory is an opt-in per function
        if $cfg.shared_mem_bytes > 48 * 1024 {
            f.set_attribute(
                candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                $cfg.shared_mem_bytes as i32,
            )
            .w()?;
        }
        let mut b = f.builder();
        $( b.arg(&$arg); )+
        // SAFETY: the arguments follow the kernel's signature in its family's source
        // (src/ops/*.cu, gathered by src/cuda/kernels.cu).
        unsafe { b.launch($cfg) }.w()?;
    }};
}
pub(crate) use launch;

/// `$body` with the element type `$t` and the dtype `$dt` of `$dtype`, for kernels built for
/// f32 and bf16 (`{name}_f32`, `{name}_bf16`); another dtype is refused, naming `$what`.
/// Example: `by_float!(x.dtype(), "silu_mul", |T, dt| { let v = view::<T>(x, l, "x")?; … })`.
macro_rules! by_float {
    ($dtype:expr, $what:expr, |$t:ident, $dt:ident| $body:block) => {{
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                let $dt = candle_core::DType::F32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                let $dt = candle_core::DType::BF16;
                $body
            }
            other => candle_core::bail!("{}: {other:?} is not supported (f32, bf16)", $what),
        }
    }};
}
pub(crate) use by_float;

/// One block of `threads` per row.
pub fn rows(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch over `n` values: 256 threads per block, at most 65,535 blocks.
pub fn elementwise(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous data of a kernel input, from its offset.
pub fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    if !l.is_contiguous() {
        candle_core::bail!("{what}: contiguous input expected");
    }
    Ok(s.as_cuda_slice::<T>()?
        .slice(l.start_offset()..l.start_offset() + l.shape().elem_count()))
}

/// The device data of a matrix `[rows, cols]` whose rows are evenly strided with unit column
/// stride (a column range of a wider product), and its row stride. Example: columns 6,144..6,240
/// of `[1, 16,480]` rows → the view from element 6,144 and a stride of 16,480.
pub fn rows_view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<(CudaView<'a, T>, usize)> {
    let (rows, cols) = l.shape().dims2()?;
    let ld = match rows {
        1 => cols,
        _ => l.stride()[0],
    };
    if (l.stride()[1] != 1 && cols > 1) || ld < cols {
        candle_core::bail!(
            "{what}: rows with unit column stride expected, strides {:?} of {:?}",
            l.stride(),
            l.shape()
        );
    }
    let len = (rows.max(1) - 1) * ld + cols;
    Ok((
        s.as_cuda_slice::<T>()?
            .slice(l.start_offset()..l.start_offset() + len),
        ld,
    ))
}

/// A fresh output of `n` values (written in full by the kernel).
pub fn alloc<T: CudaDType + DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every kernel here writes each of its output's values.
    unsafe { dev.alloc::<T>(n) }
}

/// `f` with the contiguous device data of a tensor an op holds (a layer's constants), not one
/// of its inputs. Example: the Gated DeltaNet prep reads the layer's conv weight this way.
pub fn with_held_view<R>(
    t: &candle_core::Tensor,
    what: &str,
    f: impl FnOnce(CudaView<'_, f32>) -> Result<R>,
) -> Result<R> {
    with_held::<f32, R>(t, what, f)
}

/// [`with_held_view`] for any element type. A kernel may also fill such a tensor when the op
/// created it for that and nothing else reads it before the op returns (a second output: the
/// training attention's log-sum-exp).
pub fn with_held<T: CudaDType, R>(
    t: &candle_core::Tensor,
    what: &str,
    f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("{what}: not on the GPU");
    };
    f(view::<T>(s, l, what)?)
}

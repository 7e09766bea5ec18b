//! Device and dtype names (`cpu`, `cuda`, `cuda:N`; `f32`, `bf16`, `f16`), and the CUDA
//! settings every device this process opens gets.

/// Parse a device name (`cpu`, `cuda`, `cuda:N`).
pub fn device(name: &str) -> anyhow::Result<candle_core::Device> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ord = s
                .strip_prefix("cuda:")
                .map(|n| n.parse::<usize>())
                .transpose()?
                .unwrap_or(0);
            if !candle_core::utils::cuda_is_available() {
                anyhow::bail!(
                    "device '{s}': this build has no CUDA support (build with --features cuda)"
                );
            }
            let dev = candle_core::Device::new_cuda(ord)?;
            #[cfg(feature = "cuda")]
            tune_cuda(&dev)?;
            Ok(dev)
        }
        other => anyhow::bail!("unknown device '{other}' (cpu, cuda, cuda:N)"),
    }
}

/// Freed device memory the CUDA pool keeps for reuse (see [`device`]).
pub const CUDA_POOL_KEEP: u64 = 8 << 30;

/// Two settings of a CUDA device that change no result and save driver work:
/// - **no per-tensor event tracking**: cudarc records a CUDA event on every allocation, read
///   and write so that tensors can cross streams; this process uses one stream per device
///   (candle's, from the thread that opened it; nothing here moves tensors between threads),
///   so the events only add driver calls to every kernel launch of a launch-bound loop;
/// - **a caching memory pool**: allocations are stream-ordered (`cuMemAllocAsync`) from the
///   device's default pool, whose release threshold is 0 by default, so every synchronisation
///   hands freed memory back to the driver and the next step maps it again; the pool now keeps
///   up to [`CUDA_POOL_KEEP`] of freed memory. Bounded, not unlimited: the one training run
///   with an unlimited pool (tensors of a different size every step) ran out of the H200's
///   memory after 345 steps; the pool is the likely cause, not a proven one.
#[cfg(feature = "cuda")]
fn tune_cuda(dev: &candle_core::Device) -> anyhow::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    if let candle_core::Device::Cuda(cd) = dev {
        // SAFETY: one stream per device in this process (see above)
        unsafe { cd.disable_event_tracking() };
        let stream = cd.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        // SAFETY: the device handle comes from a live context; the attribute is a u64
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
            let mut threshold: u64 = CUDA_POOL_KEEP;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )?;
        }
    }
    Ok(())
}

/// A device's memory high watermarks in bytes since the process started: what its tensors held
/// at most, and what the allocator's pool held from the driver at most (freed memory it keeps
/// for reuse included): CUDA's default pool, which every allocation of this process comes from
/// ([`tune_cuda`]; cuBLAS's workspaces and the CUDA context are outside it). Example: a 54 GB
/// target and a step whose activations peak at 30 GB read `used` ≈ 84 GB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakMemory {
    pub used: u64,
    pub reserved: u64,
}

/// [`PeakMemory`] of `dev`; `None` on the CPU.
pub fn peak_memory(dev: &candle_core::Device) -> anyhow::Result<Option<PeakMemory>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cd) = dev {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let stream = cd.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        let read = |attr: sys::CUmemPool_attribute| -> anyhow::Result<u64> {
            let mut v: u64 = 0;
            // SAFETY: the device handle comes from a live context; both attributes are u64
            unsafe {
                let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
                result::mem_pool::get_attribute(pool, attr, &mut v as *mut u64 as *mut _)?;
            }
            Ok(v)
        };
        return Ok(Some(PeakMemory {
            used: read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: read(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        }));
    }
    let _ = dev;
    Ok(None)
}

/// Parse a dtype name (`f32`, `bf16`, `f16`).
pub fn dtype(name: &str) -> anyhow::Result<candle_core::DType> {
    match name {
        "f32" => Ok(candle_core::DType::F32),
        "bf16" => Ok(candle_core::DType::BF16),
        "f16" => Ok(candle_core::DType::F16),
        other => anyhow::bail!("unknown dtype '{other}' (f32, bf16, f16)"),
    }
}

//! Where a forward's time goes on a GPU: how many kernels it launches, how long the host takes
//! to launch them, and how long the GPU takes to run them back to back.
//!
//! An eager AR step of SmolLM2-135M launches several hundred small kernels one after another;
//! if the host needs longer to launch them than the GPU needs to run them, the host sets the
//! step's time and the GPU idles between kernels. Two measurements separate the two:
//! - [`count_launches`] captures the work into a CUDA graph that is never launched and counts
//!   its nodes by kind (kernels; allocations and frees of intermediate tensors; the small
//!   host-to-device copies candle makes of strided layouts);
//! - [`host_gpu_split`] enqueues the work behind a *blocker* (matmuls that keep the GPU busy
//!   longer than the host needs to enqueue the work), so the host's enqueue time and the GPU's
//!   back-to-back time of the same kernels are measured apart: the GPU time is read from two
//!   events around the work, which the GPU reaches only after the blocker, when every kernel
//!   is already queued. The split checks itself: if the blocker ended before the host had
//!   enqueued everything (the host waited on the GPU, e.g. a full launch queue or a blocking
//!   copy), it says so instead of returning times.
//!
//! - [`capture`] captures the work into a graph and launches it; [`Captured::replay`] reruns
//!   exactly those kernels with no host work between them.
//!
//! Candle uploads the dims and strides of every strided operand from a short-lived host buffer
//! at each launch: a copy from pageable memory that can make the host wait for the stream, and
//! that a graph would replay from freed memory (the H200 reported an illegal address when a
//! forward captured that way was replayed). [`ParamCache`] turns on candle's cache of such
//! small uploads (kept on the device, keyed by content): after one warm-up run, the same work
//! uploads nothing, and its capture replays correctly.
//!
//! Example: an AR step of a small model is several hundred kernels and more allocations; when
//! the host takes longer to enqueue them than the GPU to run them, the step is the host's:
//! graphs remove the host's share, and what remains is the number of kernels
//! (`docs/BENCHMARKS.md`, where a decode step's time goes).

use anyhow::{bail, Result};
use candle_core::Device;

/// The nodes of a captured piece of work, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCounts {
    pub kernels: usize,
    /// Host-to-device copies (candle's layout uploads of strided ops).
    pub memcpy: usize,
    pub memset: usize,
    /// Stream-ordered allocations and frees of intermediate tensors.
    pub alloc: usize,
    pub free: usize,
    pub other: usize,
}

/// Count the device work `f` enqueues on `dev`'s stream by capturing it into a CUDA graph that
/// is never launched. `f` must only enqueue work (no synchronisation, no copy to the host).
/// The tensors `f` returns are leaked, never dropped: their memory was reserved for the graph
/// and never backed, so they must not be read or freed. Work that writes into existing
/// buffers (a KV cache) leaves them unchanged, since nothing runs; roll back the cache's
/// bookkeeping (its length) after the call. Errors on a CPU device or a build without CUDA.
pub fn count_launches<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<NodeCounts> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        return cuda::count_launches(cd, dev, f);
    }
    let _ = f;
    bail!("counting launches needs a CUDA device (got {dev:?})")
}

/// Candle's cache of small host-to-device uploads (layout params, host data ≤ 4 KiB, kept on
/// the device and keyed by content), on while this value lives (this thread, CUDA only).
/// Every distinct upload stays on the device for the process's life: use it around work that
/// repeats the same shapes (a benchmark's forward, a captured graph), not a growing cache.
pub struct ParamCache {
    /// candle's guard (its type is not exported); dropping it turns the cache off
    #[cfg(feature = "cuda")]
    _guard: Option<Box<dyn std::any::Any>>,
}

impl ParamCache {
    /// On for a CUDA device; nothing for the CPU.
    pub fn enable(dev: &Device) -> Self {
        #[cfg(feature = "cuda")]
        {
            let _guard = match dev {
                Device::Cuda(cd) => {
                    Some(Box::new(cd.enable_cuda_graph_htod_cache()) as Box<dyn std::any::Any>)
                }
                _ => None,
            };
            Self { _guard }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dev;
            Self {}
        }
    }
}

/// A captured, instantiated CUDA graph ([`capture`]).
pub struct Captured {
    #[cfg(feature = "cuda")]
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    pub nodes: NodeCounts,
}

impl Captured {
    /// Launch the graph once more (asynchronous: synchronise the device to wait for it).
    pub fn replay(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.graph.launch()?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        bail!("CUDA graphs need a CUDA build")
    }
}

/// Capture the device work of `f` into a CUDA graph, instantiate it, launch it once (so that
/// the tensors `f` returns hold real memory: the replay's results after a synchronisation) and
/// synchronise. Needs a warm [`ParamCache`]: `f` run once with the cache on before, so that
/// nothing is uploaded inside the capture (candle refuses a cache miss during a capture, by
/// name). The graph frees its own unfreed allocations before each relaunch, so replays do not
/// grow memory; the returned tensors keep the graph's fixed addresses across replays.
pub fn capture<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<(Captured, T)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        return cuda::capture(cd, dev, f);
    }
    let _ = f;
    bail!("CUDA graphs need a CUDA device (got {dev:?})")
}

/// Run `f` between `cuProfilerStart` and `cuProfilerStop`, the device synchronised at both
/// ends: a profiler started with its collection off (`ncu --profile-from-start off`) records
/// `f`'s kernels alone. Errors on a CPU device or a build without CUDA.
pub fn profiled_range<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::sys;
        dev.synchronize()?;
        // SAFETY: no arguments; the driver is loaded (a CUDA device exists)
        unsafe { sys::cuProfilerStart() }.result()?;
        let out = f();
        let sync = dev.synchronize();
        // SAFETY: as above
        let stop = unsafe { sys::cuProfilerStop() }.result();
        let out = out?;
        sync?;
        stop?;
        return Ok(out);
    }
    let _ = f;
    bail!("a profiled range needs a CUDA device (got {dev:?})")
}

/// How a fixed-shape forward is captured: `f` runs once eagerly with candle's param cache on
/// (every layout upload lands in the cache), `cache` goes back to `len` rows, then the same
/// forward is recorded by [`capture`] (with the cache still on). Example: an AR step at cache
/// 40 runs, the cache is cut back to 40, the step is captured.
pub fn warm_capture<T>(
    dev: &Device,
    cache: &mut crate::KvCache,
    len: usize,
    mut f: impl FnMut(&mut crate::KvCache) -> Result<T>,
) -> Result<(Captured, T)> {
    let _params = ParamCache::enable(dev);
    f(cache)?;
    cache.truncate(len)?;
    capture(dev, || f(cache))
}

/// A host/GPU time split ([`host_gpu_split`]), in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostGpu {
    /// Wall time for the host to enqueue the work (the call of `f`).
    pub host: f64,
    /// GPU time from the first to the last of the work's kernels, run back to back.
    pub gpu: f64,
}

/// Enqueue `f` behind a blocker of at least `blocker_secs` of GPU work and measure the host's
/// enqueue time and the GPU's time for `f`'s kernels (see the module docs). Fails, naming the
/// cause, when the blocker ended before the host finished enqueueing (raise `blocker_secs`).
/// Errors on a CPU device or a build without CUDA.
pub fn host_gpu_split<T>(
    dev: &Device,
    blocker_secs: f64,
    f: impl FnOnce() -> Result<T>,
) -> Result<(HostGpu, T)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        return cuda::host_gpu_split(cd, dev, blocker_secs, f);
    }
    let _ = (f, blocker_secs);
    bail!("a host/GPU split needs a CUDA device (got {dev:?})")
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Captured, HostGpu, NodeCounts};
    use anyhow::{bail, Context, Result};
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device, Tensor};
    use std::time::Instant;

    /// Run `f` on `dev`'s stream inside a capture and end it whatever `f` did (or the stream
    /// stays in capture mode): the instantiated graph (`flags`) and `f`'s result. Tensors `f`
    /// returns hold memory reserved for the graph, backed only once it is launched.
    fn record<T>(
        cd: &CudaDevice,
        dev: &Device,
        flags: sys::CUgraphInstantiate_flags,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(Result<Option<CudaGraph>>, Result<T>)> {
        dev.synchronize()?;
        let stream = cd.cuda_stream();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .context("starting a CUDA graph capture")?;
        let out = f().context("the work inside the CUDA graph capture failed");
        let graph = stream
            .end_capture(flags)
            .context("ending the CUDA graph capture");
        Ok((graph, out))
    }

    pub fn count_launches<T>(
        cd: &CudaDevice,
        dev: &Device,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<NodeCounts> {
        let (graph, out) = record(cd, dev, sys::CUgraphInstantiate_flags(0), f)?;
        // never backed: must not be freed (see the docs)
        std::mem::forget(out?);
        let graph = graph?.context("the CUDA graph capture recorded no work")?;
        count_nodes(graph.cu_graph())
    }

    pub fn capture<T>(
        cd: &CudaDevice,
        dev: &Device,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(Captured, T)> {
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let (graph, out) = record(cd, dev, flags, f)?;
        let out = out?;
        let graph = match graph {
            Ok(Some(g)) => g,
            other => {
                // the outputs' memory was never backed: never free it
                std::mem::forget(out);
                other?;
                anyhow::bail!("the CUDA graph capture recorded no work")
            }
        };
        let nodes = count_nodes(graph.cu_graph())?;
        graph
            .launch()
            .context("launching the captured CUDA graph")?;
        dev.synchronize()
            .context("running the captured CUDA graph")?;
        Ok((Captured { graph, nodes }, out))
    }

    fn count_nodes(g: sys::CUgraph) -> Result<NodeCounts> {
        let mut n = 0usize;
        // SAFETY: `g` is a live graph owned by the caller's CudaGraph; the first call reads
        // only the count, the second fills `n` node handles
        unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
            .result()
            .context("counting the graph's nodes")?;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
            .result()
            .context("listing the graph's nodes")?;
        let mut c = NodeCounts::default();
        for &node in &nodes[..n] {
            let mut t = std::mem::MaybeUninit::<sys::CUgraphNodeType>::uninit();
            // SAFETY: `node` belongs to `g`; the driver writes one enum value
            unsafe { sys::cuGraphNodeGetType(node, t.as_mut_ptr()) }
                .result()
                .context("reading a graph node's type")?;
            // CUgraphNodeType: 0 kernel, 1 memcpy, 2 memset, 10 mem alloc, 11 mem free
            match unsafe { t.assume_init() } as u32 {
                0 => c.kernels += 1,
                1 => c.memcpy += 1,
                2 => c.memset += 1,
                10 => c.alloc += 1,
                11 => c.free += 1,
                _ => c.other += 1,
            }
        }
        Ok(c)
    }

    /// Enqueue f32 matmuls of 4096² (≈ 137 GFLOP each) worth at least `secs` of GPU time,
    /// calibrated on one timed matmul.
    fn enqueue_blocker(dev: &Device, secs: f64) -> Result<f64> {
        let a = Tensor::ones((4096, 4096), DType::F32, dev)?;
        let _ = a.matmul(&a)?;
        dev.synchronize()?;
        let t = Instant::now();
        let _ = a.matmul(&a)?;
        dev.synchronize()?;
        let one = t.elapsed().as_secs_f64().max(1e-5);
        let k = (secs / one).ceil().max(1.0) as usize;
        let mut x = a.clone();
        for _ in 0..k {
            // the product stays finite: ones · ones = 4096, scaled back to ones
            x = (x.matmul(&a)? * (1.0 / 4096.0))?;
        }
        // one reference kept until the end of the chain is enough: candle frees the rest
        drop(x);
        Ok(k as f64 * one)
    }

    pub fn host_gpu_split<T>(
        cd: &CudaDevice,
        dev: &Device,
        blocker_secs: f64,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(HostGpu, T)> {
        let stream = cd.cuda_stream();
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        dev.synchronize()?;
        let blocker = enqueue_blocker(dev, blocker_secs)?;
        let start = stream.record_event(timing)?;
        let t = Instant::now();
        let out = f()?;
        let host = t.elapsed().as_secs_f64();
        let blocker_done = start.try_is_complete()?;
        let end = stream.record_event(timing)?;
        let gpu = start.elapsed_ms(&end)? as f64 / 1e3;
        dev.synchronize()?;
        if blocker_done {
            bail!(
                "the GPU finished the {:.1} ms blocker before the host had enqueued the work ({:.1} ms): the host waited on the GPU (a full launch queue or a blocking copy), so the split would be wrong; raise the blocker",
                blocker * 1e3,
                host * 1e3
            );
        }
        Ok((HostGpu { host, gpu }, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_device_is_refused_by_name() {
        let _cache = ParamCache::enable(&Device::Cpu);
        let e = capture(&Device::Cpu, || Ok(())).err().unwrap();
        assert!(e.to_string().contains("need a CUDA device"), "{e}");
        let e = count_launches(&Device::Cpu, || Ok(())).err().unwrap();
        assert!(e.to_string().contains("needs a CUDA device"), "{e}");
        let e = host_gpu_split(&Device::Cpu, 0.01, || Ok(())).err().unwrap();
        assert!(e.to_string().contains("needs a CUDA device"), "{e}");
    }
}

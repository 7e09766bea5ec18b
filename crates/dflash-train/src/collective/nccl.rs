//! Ranks on GPUs through NCCL (one process per GPU): the [`Collective`] the trainer sums its
//! gradients through when `train --gpus N` launches it. The sum is NCCL's (ring or tree, its
//! choice): N GPU ranks equal one rank up to rounding, not bit for bit as the CPU ranks do.
//!
//! The collectives run on a stream of their own (the comm stream), ordered after the device's
//! stream by an event: a sum started while the backward is still being enqueued runs beside
//! the backward's later kernels, and the device's stream waits for the sum only where the sum
//! is read ([`PendingSum::wait`]). The buffers are the device stream's (allocated and freed
//! there), held by the pending sum until that wait.

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::cuda::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::{CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::{Collective, PendingSum};

/// One rank of an NCCL group, on this process's GPU; its collectives on their own stream.
pub struct NcclRank {
    comm: Comm,
    device: candle_core::CudaDevice,
    /// the stream `comm` runs on (forked from the device's)
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread at a time
// does; the trainer drives its rank from one thread.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

/// A new NCCL unique id (rank 0 makes it and hands it to the others: [`super::rendezvous`]).
pub fn unique_id() -> Result<[u8; 128]> {
    let id = Id::new()
        .map_err(|e| anyhow!("NCCL: no unique id ({e:?}): is libnccl.so.2 on LD_LIBRARY_PATH?"))?;
    Ok(id.internal().map(|c| c as u8))
}

impl NcclRank {
    /// Join the group `id` as `rank` of `world` on `device` (a CUDA device).
    pub fn new(device: &Device, rank: usize, world: usize, id: [u8; 128]) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            bail!("NCCL ranks need a CUDA device, not {device:?}");
        };
        let stream = dev.cuda_stream().fork()?;
        let comm = Comm::from_rank(
            stream.clone(),
            rank,
            world,
            Id::uninit(id.map(|b| b as std::ffi::c_char)),
        )
        .map_err(|e| anyhow!("NCCL: rank {rank} of {world} could not join ({e:?})"))?;
        Ok(Self {
            comm,
            device: dev.clone(),
            stream,
        })
    }
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world(&self) -> usize {
        self.comm.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.start_all_reduce(t)?.wait()
    }
    fn start_all_reduce(&self, t: &Tensor) -> Result<PendingSum> {
        let src = t.contiguous()?;
        let done = Mutex::new(None);
        let sum = src.apply_op1_no_bwd(&AllReduce {
            comm: &self.comm,
            stream: &self.stream,
            done: &done,
        })?;
        let done: CudaEvent = done
            .into_inner()
            .map_err(|_| anyhow!("NCCL all-reduce: its event was poisoned"))?
            .ok_or_else(|| anyhow!("NCCL all-reduce: no event recorded"))?;
        let device = self.device.cuda_stream();
        Ok(PendingSum::deferred(move || {
            // the device's stream reads the sum (and may reuse the source's memory) only
            // after the comm stream is done with both
            device.wait(&done)?;
            drop(src);
            Ok(sum)
        }))
    }
    fn all_gather(&self, v: &[f64]) -> Result<Vec<f64>> {
        // host values only: the copies and the gather on the comm stream, which the copy back
        // synchronises
        let send = self.stream.clone_htod(v)?;
        let mut recv = self.stream.alloc_zeros::<f64>(v.len() * self.world())?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(|e| anyhow!("NCCL all-gather: {e:?}"))?;
        Ok(self.stream.clone_dtoh(&recv)?)
    }
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[0.0])?;
        Ok(())
    }
}

/// The element-wise sum over the ranks, into a fresh tensor of the device's stream, taken on
/// the comm stream after the device stream's work so far; the event that ends it goes to
/// `done`.
struct AllReduce<'a> {
    comm: &'a Comm,
    stream: &'a Arc<CudaStream>,
    done: &'a Mutex<Option<CudaEvent>>,
}

impl AllReduce<'_> {
    /// The sum over the ranks of `s`'s values (layout `l`), into a fresh buffer.
    fn sum<T>(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<CudaStorage>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda::cudarc::driver::DeviceRepr
            + candle_core::cuda::cudarc::driver::ValidAsZeroBits
            + candle_core::cuda::cudarc::nccl::safe::NcclType,
    {
        let dev = s.device().clone();
        let n = l.shape().elem_count();
        let src = s
            .as_cuda_slice::<T>()?
            .slice(l.start_offset()..l.start_offset() + n);
        let mut dst = dev.alloc_zeros::<T>(n)?;
        let msg = |e: String| candle_core::Error::Msg(format!("NCCL all-reduce: {e}"));
        // the source written and the destination zeroed on the device's stream first
        self.stream
            .join(&dev.cuda_stream())
            .map_err(|e| msg(format!("{e:?}")))?;
        self.comm
            .all_reduce(&src, &mut dst, &ReduceOp::Sum)
            .map_err(|e| msg(format!("{e:?}")))?;
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| msg(format!("{e:?}")))?;
        *self.done.lock().map_err(|_| msg("poisoned".into()))? = Some(ev);
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("an NCCL all-reduce needs its tensor on the GPU")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => self.sum::<f32>(s, l)?,
            DType::F64 => self.sum::<f64>(s, l)?,
            other => {
                candle_core::bail!("NCCL all-reduce: {other:?} gradients (f32 or f64 expected)")
            }
        };
        Ok((out, l.shape().clone()))
    }
}

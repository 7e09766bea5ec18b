//! Timing helpers shared by the benchmarks: medians of device-synchronised wall times, and the
//! memory floor's bandwidth.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median wall time of `f` over `reps` runs after one warm-up run, the device synchronised
/// before and after each.
pub fn time(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::new();
    for i in 0..=reps.max(1) {
        dev.synchronize()?;
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        if i > 0 {
            v.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(v))
}

/// Measured memory bandwidth in bytes/s: a device copy (read + write) of 1 GiB on a GPU,
/// 128 MiB on the CPU, into a preallocated buffer (an allocation inside the timed copy makes
/// the figure depend on the allocator's state), median of 5.
pub fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let bytes = if dev.is_cpu() {
        1usize << 27
    } else {
        1usize << 30
    };
    let src = Tensor::ones(bytes / 4, DType::F32, dev)?;
    let dst = Tensor::zeros(bytes / 4, DType::F32, dev)?;
    let t = time(dev, 5, || {
        dst.slice_set(&src, 0, 0)?;
        Ok(())
    })?;
    Ok(2.0 * bytes as f64 / t)
}

/// Measured read bandwidth in bytes/s: a sum of each row of a 1 GiB buffer on a GPU (128 MiB
/// on the CPU), median of 5. The floor of a forward that reads every weight once is
/// weight bytes ÷ this (a copy's figure also spends bandwidth on its writes).
pub fn read_bandwidth(dev: &Device) -> Result<f64> {
    let bytes = if dev.is_cpu() {
        1usize << 27
    } else {
        1usize << 30
    };
    // 4,096 rows summed in parallel (one reduction over the whole buffer runs on one block)
    let rows = 4096;
    let src = Tensor::ones((rows, bytes / 4 / rows), DType::F32, dev)?;
    let t = time(dev, 5, || {
        src.sum_keepdim(1)?;
        Ok(())
    })?;
    Ok(bytes as f64 / t)
}

/// This process's resident memory in bytes, `(VmRSS, VmHWM)` (now and at its peak) from
/// `/proc/self/status`; `None` where that file is absent (not Linux) or lacks either line.
pub fn resident_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

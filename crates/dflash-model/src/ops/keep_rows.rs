//! A tree's committed path moved down in every K/V buffer of a cache (the compaction after a
//! tree verify, [`crate::cache::KvCache::keep_rows`]): in each buffer `[b, h, cap, d]`, row
//! `fixed + j` becomes row `moved[j]`. The twin, and every other device, gathers the moved rows
//! of each buffer and writes them back (`index_select` then `slice_set`: two launches per
//! buffer, 120 for SmolLM2's 30 layers of K and V). On a GPU one kernel (`keep_rows_*` in
//! `src/ops/keep_rows.cu`) moves the rows of every buffer in one launch, from a table of the
//! buffers' addresses and the rows uploaded together (docs/BENCHMARKS.md, "A tree's compaction
//! in one launch"); `DFLASH_DISABLED_KERNELS=keep-rows` turns it off.
//!
//! The kernel walks the moves in order, in place, so it takes only moves where no row is
//! written before a later move reads it: `moved` ascending with `moved[j] >= fixed + j`
//! ([`in_order`]), which a root-to-node path always is (a child's row is after its parent's).
//! Example: cache rows 0..10, a tree of 8 rows at 10..18 whose path is tree rows [0, 2, 5]
//! → `fixed` 11 (rows 0..11 stay), `moved` [12, 15]: row 11 ← 12, row 12 ← 15.

use candle_core::{Result, Tensor};

/// Whether the moves can run in place in order: `moved` strictly ascending and
/// `moved[j] >= fixed + j`. Example: fixed 10, [11, 12] → yes (row 10 ← 11, row 11 ← 12);
/// [12, 11] → no (not ascending); [5, 12] → no (row 5 is before `fixed`). The gather takes those.
pub fn in_order(fixed: usize, moved: &[u32]) -> bool {
    moved
        .iter()
        .enumerate()
        .all(|(j, &r)| r as usize >= fixed + j)
        && moved.windows(2).all(|w| w[0] < w[1])
}

/// Move rows `moved` of every buffer to rows `fixed ..` (see the module docs). Every buffer
/// must hold rows `moved` and `fixed .. fixed + moved.len()` (the caller checks the cache
/// length).
pub fn keep_rows(buffers: &[&Tensor], fixed: usize, moved: &[u32]) -> Result<()> {
    if moved.is_empty() || buffers.is_empty() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if kernel_serves(buffers, fixed, moved) {
        return cuda::launch(buffers, fixed, moved);
    }
    gather(buffers, fixed, moved)
}

/// The twin: each buffer's moved rows gathered, then written at `fixed`.
pub fn gather(buffers: &[&Tensor], fixed: usize, moved: &[u32]) -> Result<()> {
    let idx = Tensor::from_vec(moved.to_vec(), moved.len(), buffers[0].device())?;
    for b in buffers {
        let rows = b.index_select(&idx, 2)?;
        b.slice_set(&rows, 2, fixed)?;
    }
    Ok(())
}

/// The kernel takes the moves: a CUDA device, f32 or bf16, every buffer contiguous `[b, h, cap,
/// d]` of one shape and dtype, the moves [`in_order`] and inside the buffers, not switched off.
#[cfg(feature = "cuda")]
fn kernel_serves(buffers: &[&Tensor], fixed: usize, moved: &[u32]) -> bool {
    let first = buffers[0];
    let same = buffers.iter().all(|b| {
        b.device().same_device(first.device())
            && b.dims() == first.dims()
            && b.dtype() == first.dtype()
            && b.is_contiguous()
    });
    first.device().is_cuda()
        && same
        && first.rank() == 4
        && matches!(
            first.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16
        )
        && in_order(fixed, moved)
        && moved
            .last()
            .is_some_and(|&r| (r as usize) < first.dims()[2])
        && !dflash_core::runtime::off(dflash_core::runtime::Kernel::KeepRows)
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::cuda::ptx::{by_float, elementwise, launch};
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::Storage;

    /// One upload (the buffers' addresses, then the rows) and one launch.
    pub(super) fn launch(buffers: &[&Tensor], fixed: usize, moved: &[u32]) -> Result<()> {
        let first = buffers[0];
        let (b, h, cap, d) = first.dims4()?;
        let dev = match first.device() {
            candle_core::Device::Cuda(c) => c.clone(),
            _ => candle_core::bail!("keep_rows: not on the GPU"),
        };
        let stream = dev.cuda_stream();
        let guards: Vec<_> = buffers.iter().map(|t| t.storage_and_layout()).collect();
        by_float!(first.dtype(), "keep_rows", |T, dt| {
            let mut table: Vec<u64> = Vec::with_capacity(buffers.len() + moved.len());
            let mut syncs = Vec::with_capacity(buffers.len());
            for (s, l) in &guards {
                let Storage::Cuda(c) = &**s else {
                    candle_core::bail!("keep_rows: a buffer is not on the GPU");
                };
                let (ptr, sync) = c.as_cuda_slice::<T>()?.device_ptr(&stream);
                table.push(ptr + (l.start_offset() * std::mem::size_of::<T>()) as u64);
                syncs.push(sync);
            }
            table.extend(moved.iter().map(|&r| r as u64));
            let table = dev.clone_htod(&table)?;
            let (n, bh, cap_, d_, fixed_, m) = (
                buffers.len() as u64,
                (b * h) as u64,
                cap as u64,
                d as u64,
                fixed as u64,
                moved.len() as u64,
            );
            launch!(
                dev,
                "keep_rows",
                dt,
                elementwise(n * bh * d_),
                table,
                n,
                bh,
                cap_,
                d_,
                fixed_,
                m
            );
            drop(syncs);
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_path_moves_in_order_and_other_orders_do_not() {
        assert!(in_order(10, &[11, 12]));
        assert!(in_order(11, &[12, 15]));
        assert!(in_order(3, &[3, 4]));
        assert!(!in_order(10, &[12, 11]));
        assert!(!in_order(10, &[5, 12]));
        assert!(!in_order(10, &[11, 11]));
    }

    #[test]
    fn the_gather_moves_rows_of_every_buffer() -> Result<()> {
        // two buffers [1, 2, 6, 2] whose value is 100·buffer + 10·row + column
        let make = |p: usize| {
            let v: Vec<f32> = (0..2 * 6 * 2)
                .map(|i| (100 * p + 10 * ((i / 2) % 6) + i % 2) as f32)
                .collect();
            Tensor::from_vec(v, (1, 2, 6, 2), &Device::Cpu)
        };
        let (a, b) = (make(0)?, make(1)?);
        keep_rows(&[&a, &b], 2, &[3, 5])?;
        let rows = b.get(0)?.get(1)?.to_vec2::<f32>()?;
        assert_eq!(
            rows[..4],
            [[100., 101.], [110., 111.], [130., 131.], [150., 151.]]
        );
        assert_eq!(a.get(0)?.get(0)?.to_vec2::<f32>()?[3], [50., 51.]);
        Ok(())
    }
}

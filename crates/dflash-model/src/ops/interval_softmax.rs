//! The target's attention softmax when every query row sees one interval of keys (prefill,
//! a chain's verify, batched decoding: the causal and right-aligned rules): scale, mask and
//! softmax in one pass over the scores as the matmul wrote them, instead of a scale, a cast to
//! f32, a broadcast mask add, the softmax and a cast back (five full passes; a SmolLM2 prefill
//! of 16 prompts spent two thirds of its GPU time there, `docs/BENCHMARKS.md`).
//! Forward only: the target has no gradient ([`crate::layers::attention::attend_intervals`] refuses
//! inputs that carry a graph).
//!
//! Example: causal over [cache 2 | new 2] → row 0 sees keys 0..3, row 1 sees 0..4; scores row
//! 0 `[1, 2, 3, 9]` at scale 1 → softmax of `[1, 2, 3]` and 0 for key 3.
//!
//! On the CPU the rows run in Rust (the reference); with CUDA, `src/ops/interval_softmax.cu`.

use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, WithDType};
use dflash_core::visibility::Visibility;

use crate::ops::kernel_io::{cpu_slice, KernelTable};

/// The visible keys of each query row of `b` sequences × `n` rows: `[lo, hi)` per row, and
/// for a tree's verify ([`RowIntervals::tree_widened`]) a window of the
/// [`dflash_core::visibility::WINDOW`] columns from `hi` (bit `i` = column `hi + i`: the
/// ancestors past the interval), from [`Visibility::row_window`].
#[derive(Debug, Clone)]
pub struct RowIntervals {
    /// Per row `[lo, hi]`, or `[lo, hi, window bits 0..32, bits 32..64]` when `window`.
    pub(crate) table: KernelTable,
    pub b: usize,
    pub n: usize,
    /// Key columns of the masks they came from.
    pub cols: usize,
    /// Whether each row has a window past its interval (four words per row).
    pub window: bool,
}

impl RowIntervals {
    /// The intervals of `b` visibility matrices (`[n, cols]` each), or `None` when a row does
    /// not see one interval (a tree's verify).
    pub fn from_visibilities(masks: &[Visibility], device: &Device) -> Result<Option<Self>> {
        let cols = masks.first().map_or(0, |m| m.cols);
        Self::widened(masks, cols, device)
    }

    /// [`RowIntervals::from_visibilities`] over `cols ≥` the masks' columns (a cache of fixed
    /// capacity: the columns past the masks' are seen by no row). Example: right-aligned rows
    /// over 41 columns widened to 128 → the same intervals, `cols` 128.
    pub fn widened(masks: &[Visibility], cols: usize, device: &Device) -> Result<Option<Self>> {
        let n = match masks.first() {
            Some(m) => m.rows,
            None => return Ok(None),
        };
        if masks[0].cols > cols {
            candle_core::bail!(
                "masks of {} columns cannot be widened to {cols}",
                masks[0].cols
            );
        }
        let mcols = masks[0].cols;
        let mut host = Vec::with_capacity(masks.len() * n * 2);
        for m in masks {
            if (m.rows, m.cols) != (n, mcols) {
                candle_core::bail!(
                    "masks of different shapes: {}x{} and {n}x{mcols}",
                    m.rows,
                    m.cols
                );
            }
            for r in 0..n {
                let Some(iv) = m.row_interval(r) else {
                    return Ok(None);
                };
                host.extend([iv.start as u32, iv.end as u32]);
            }
        }
        Self::new(host, masks.len(), n, cols, device).map(Some)
    }

    /// The rows of one visibility matrix as intervals with windows ([`Visibility::row_window`])
    /// over `cols ≥` its columns, or `None` when a row sees a column past its window: a tree's
    /// verify for the tree kernel ([`crate::ops::interval_attention::fused_tree`]).
    /// Example: tree(5, [None, Some(0), Some(0), Some(2)]) → rows 0..6 / 0, 0..7 / 0, 0..6 /
    /// 0b10, 0..6 / 0b110.
    pub fn tree_widened(mask: &Visibility, cols: usize, device: &Device) -> Result<Option<Self>> {
        if mask.cols > cols {
            candle_core::bail!(
                "a mask of {} columns cannot be widened to {cols}",
                mask.cols
            );
        }
        let mut host = Vec::with_capacity(mask.rows * 4);
        for r in 0..mask.rows {
            let Some((iv, bits)) = mask.row_window(r) else {
                return Ok(None);
            };
            host.extend([
                iv.start as u32,
                iv.end as u32,
                bits as u32,
                (bits >> 32) as u32,
            ]);
        }
        let mut t = Self::new(host, 1, mask.rows, cols, device)?;
        t.window = true;
        Ok(Some(t))
    }

    /// The intervals of `b` sequences × `n` rows given directly (`rows[s · n + r]`, e.g. from
    /// [`dflash_core::visibility::right_aligned_rows`]), over `cols` key columns.
    pub fn from_rows(
        rows: &[Range<usize>],
        b: usize,
        n: usize,
        cols: usize,
        device: &Device,
    ) -> Result<Self> {
        if rows.len() != b * n {
            candle_core::bail!("{} key intervals for {b} sequences of {n} rows", rows.len());
        }
        if let Some(r) = rows.iter().find(|r| r.start > r.end || r.end > cols) {
            candle_core::bail!("key interval {r:?} does not lie in {cols} columns");
        }
        let host = rows
            .iter()
            .flat_map(|r| [r.start as u32, r.end as u32])
            .collect();
        Self::new(host, b, n, cols, device)
    }

    fn new(host: Vec<u32>, b: usize, n: usize, cols: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            table: KernelTable::new(host, device)?,
            b,
            n,
            cols,
            window: false,
        })
    }

    /// Copy these intervals into `dst`'s buffers in place (the same shape): a captured
    /// forward's inputs for the next replay.
    pub fn write_into(&self, dst: &mut RowIntervals) -> Result<()> {
        if (self.b, self.n, self.cols, self.window) != (dst.b, dst.n, dst.cols, dst.window) {
            candle_core::bail!(
                "intervals of {} × {} rows over {} keys cannot be written into {} × {} over {}",
                self.b,
                self.n,
                self.cols,
                dst.b,
                dst.n,
                dst.cols
            );
        }
        self.table.write_into(&mut dst.table)
    }

    /// Words per row in the kernels' table: 2, or 4 with a window.
    pub fn words(&self) -> usize {
        if self.window {
            4
        } else {
            2
        }
    }

    /// Row `r` of sequence `s`: its interval.
    pub fn get(&self, s: usize, r: usize) -> Range<usize> {
        let h = &self.table.host[self.words() * (s * self.n + r)..];
        h[0] as usize..h[1] as usize
    }

    /// Row `r` of sequence `s`: its window's bits (0 without a window).
    pub fn bits(&self, s: usize, r: usize) -> u64 {
        if !self.window {
            return 0;
        }
        let h = &self.table.host[4 * (s * self.n + r)..];
        h[2] as u64 | (h[3] as u64) << 32
    }

    /// Row `r` of sequence `s`: every visible column, in order. Example: the docs' tree row 3
    /// → `[0, 1, 2, 3, 4, 5, 7, 8]`.
    pub fn columns(&self, s: usize, r: usize) -> Vec<usize> {
        let (iv, bits) = (self.get(s, r), self.bits(s, r));
        (iv.start..iv.end + dflash_core::visibility::WINDOW)
            .filter(|&c| dflash_core::visibility::window_sees(&iv, bits, c))
            .collect()
    }
}

/// `softmax(scale · scores)` over each row's interval, 0 elsewhere. `scores`:
/// `[b, hkv, g · n, t]` (contiguous, as `q · kᵀ` comes out), `t == iv.cols`; same shape and
/// dtype back.
pub fn interval_softmax(scores: &Tensor, iv: &RowIntervals, scale: f64) -> Result<Tensor> {
    let (b, _, gn, t) = scores.dims4()?;
    if b != iv.b || t != iv.cols || gn % iv.n != 0 {
        candle_core::bail!(
            "interval softmax: scores {:?} do not fit {} sequences of {} rows over {} keys",
            scores.dims(),
            iv.b,
            iv.n,
            iv.cols
        );
    }
    scores.contiguous()?.apply_op1_no_bwd(&Op { iv, scale })
}

struct Op<'a> {
    iv: &'a RowIntervals,
    scale: f64,
}

/// The CPU twin: each row's softmax over its interval, zeros elsewhere; rows in parallel on
/// [`crate::cpu::helpers`]. f64
/// scores compute in f64, every other dtype in f32 (one `exp` per visible key).
fn rows<T: WithDType>(
    s: &[T],
    iv: &RowIntervals,
    rows_per_seq: usize,
    t: usize,
    scale: f64,
) -> Vec<T> {
    let mut p = vec![T::zero(); s.len()];
    let n_rows = s.len().checked_div(t).unwrap_or(0);
    let out = crate::cpu::panels::SyncPtr(p.as_mut_ptr());
    let run = |rows: std::ops::Range<usize>| {
        for row in rows {
            let keys = iv.get(row / rows_per_seq, row % iv.n);
            // SAFETY: row `row` of p (t values) belongs to this chunk alone; p outlives the call
            let y = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(row * t), t) };
            let x = &s[row * t..(row + 1) * t];
            if iv.window {
                let cols = iv.columns(row / rows_per_seq, row % iv.n);
                let xs: Vec<T> = cols.iter().map(|&c| x[c]).collect();
                let mut ys = vec![T::zero(); cols.len()];
                if T::DTYPE == DType::F64 {
                    softmax_into::<f64, T>(&xs, &mut ys, scale);
                } else {
                    softmax_into::<f32, T>(&xs, &mut ys, scale);
                }
                for (&c, yv) in cols.iter().zip(ys) {
                    y[c] = yv;
                }
                continue;
            }
            if T::DTYPE == DType::F64 {
                softmax_into::<f64, T>(&x[keys.clone()], &mut y[keys], scale);
            } else {
                softmax_into::<f32, T>(&x[keys.clone()], &mut y[keys], scale);
            }
        }
    };
    // rows in chunks on the calling thread and the CPU kernels' helpers (crate::cpu::helpers)
    let chunk = 16;
    if s.len() < crate::cpu::panels::INLINE_FMAS {
        run(0..n_rows);
    } else {
        crate::cpu::helpers::for_each_chunk(n_rows.div_ceil(chunk), &|c| {
            run(c * chunk..((c + 1) * chunk).min(n_rows))
        });
    }
    p
}

/// `y = softmax(scale · x)` computed in `F`, one `exp` per key, rounded to `T` once.
fn softmax_into<F: num_traits::Float, T: WithDType>(x: &[T], y: &mut [T], scale: f64) {
    let f = |v: f64| F::from(v).expect("a float");
    let back = |v: F| v.to_f64().expect("a float");
    let sc = f(scale);
    let m = x
        .iter()
        .map(|v| f(v.to_f64()) * sc)
        .fold(F::neg_infinity(), F::max);
    let e: Vec<F> = x.iter().map(|v| (f(v.to_f64()) * sc - m).exp()).collect();
    let sum = e.iter().fold(F::zero(), |a, &b| a + b);
    let inv = if sum > F::zero() {
        sum.recip()
    } else {
        F::zero()
    };
    for (out, &ej) in y.iter_mut().zip(&e) {
        *out = T::from_f64(back(ej * inv));
    }
}

impl CustomOp1 for Op<'_> {
    fn name(&self) -> &'static str {
        "interval-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        let (t, rows_per_seq) = (dims[3], dims[1] * dims[2]);
        macro_rules! run {
            ($ty:ty) => {
                <$ty as WithDType>::to_cpu_storage_owned(rows(
                    cpu_slice::<$ty>(s, l, "interval softmax")?,
                    self.iv,
                    rows_per_seq,
                    t,
                    self.scale,
                ))
            };
        }
        let out = match s.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::BF16 => run!(half::bf16),
            DType::F16 => run!(half::f16),
            other => candle_core::bail!("interval softmax: {other:?} scores are not supported"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        if self.iv.window {
            candle_core::bail!("interval softmax: a tree's windows are the tree kernel's (fused_tree) or the CPU's");
        }
        let dims = l.shape().dims();
        let (t, rows_per_seq) = (dims[3] as i32, (dims[1] * dims[2]) as i32);
        let n_rows = dims[0] * dims[1] * dims[2];
        let count = l.shape().elem_count();
        let dev = s.device().clone();
        let (n, scale) = (self.iv.n as i32, self.scale as f32);
        let cfg = rows(n_rows, 128);
        self.iv
            .table
            .with_cuda_view("interval softmax intervals", |iv| {
                macro_rules! run {
                    ($ty:ty, $dt:expr) => {{
                        let sv = view::<$ty>(s, l, "scores")?;
                        let p = alloc::<$ty>(&dev, count)?;
                        launch!(
                            dev,
                            "interval_softmax_fwd",
                            $dt,
                            cfg,
                            sv,
                            p,
                            iv,
                            rows_per_seq,
                            n,
                            t,
                            scale
                        );
                        candle_core::CudaStorage::wrap_cuda_slice(p, dev.clone())
                    }};
                }
                let out = match s.dtype() {
                    DType::F32 => run!(f32, DType::F32),
                    DType::BF16 => run!(half::bf16, DType::BF16),
                    other => {
                        candle_core::bail!("interval softmax: no CUDA kernel for {other:?} scores")
                    }
                };
                Ok((out, l.shape().clone()))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::visibility::{causal, right_aligned, tree};

    /// The module doc's example; the intervals are exactly the visibility's visible cells.
    #[test]
    fn the_docs_example() {
        let iv = RowIntervals::from_visibilities(&[causal(2, 2)], &Device::Cpu)
            .unwrap()
            .unwrap();
        assert_eq!((iv.get(0, 0), iv.get(0, 1)), (0..3, 0..4));
        let s = Tensor::new(
            &[[[[1f64, 2.0, 3.0, 9.0], [0.0, 0.0, 0.0, 0.0]]]],
            &Device::Cpu,
        )
        .unwrap();
        let p = interval_softmax(&s, &iv, 1.0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec3::<f64>()
            .unwrap();
        let z: f64 = [1f64, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        let want = [1f64.exp() / z, 2f64.exp() / z, 3f64.exp() / z, 0.0];
        for (a, b) in p[0][0].iter().zip(&want) {
            assert!((a - b).abs() < 1e-12);
        }
        assert!(p[0][1].iter().all(|x| (x - 0.25).abs() < 1e-12));
        let v = causal(2, 2);
        for r in 0..2 {
            let visible: Vec<usize> = (0..4).filter(|&c| v.get(r, c)).collect();
            assert_eq!(visible, iv.get(0, r).collect::<Vec<_>>());
        }
        // a tree's rows are not intervals
        let t = tree(0, &[None, Some(0), Some(0)]);
        assert!(RowIntervals::from_visibilities(&[t], &Device::Cpu)
            .unwrap()
            .is_none());
    }

    /// Batched right-aligned masks, several heads: equal to scale, the target's additive mask of
    /// the same visibilities ([`crate::layers::attention::mask_tensors`]) and softmax.
    #[test]
    fn equals_the_additive_mask_and_softmax() {
        let masks = [
            right_aligned(3, 5, 2, 2),
            right_aligned(1, 5, 2, 2),
            causal(5, 2),
        ];
        let iv = RowIntervals::from_visibilities(&masks, &Device::Cpu)
            .unwrap()
            .unwrap();
        let (b, hkv, g, n, t) = (3, 2, 3, 2, 7);
        let s = Tensor::arange(0f32, (b * hkv * g * n * t) as f32, &Device::Cpu)
            .unwrap()
            .affine(0.37, 0.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((b, hkv, g * n, t))
            .unwrap();
        let got = interval_softmax(&s, &iv, 0.7).unwrap();
        let mask =
            crate::layers::attention::mask_tensors(&masks, DType::F32, &Device::Cpu).unwrap();
        let want = candle_nn::ops::softmax_last_dim(
            &(s * 0.7)
                .unwrap()
                .reshape((b, hkv, g, n, t))
                .unwrap()
                .broadcast_add(&mask)
                .unwrap(),
        )
        .unwrap()
        .reshape((b, hkv, g * n, t))
        .unwrap();
        assert!(crate::ops::compare::max_abs(&got, &want).unwrap() < 1e-6);
    }

    /// A tree's verify (a padded DDTree-style tree, widened to a fixed capacity) through its
    /// windows: the docs' example row, and equal to the additive mask of the same visibility and
    /// softmax (the tree kernel's twin); a row past its window gives no windows.
    #[test]
    fn tree_windows_equal_the_additive_mask_and_softmax() {
        use dflash_core::visibility::pad_rows;
        let docs = tree(5, &[None, Some(0), Some(0), Some(2)]);
        let w = RowIntervals::tree_widened(&docs, 9, &Device::Cpu)
            .unwrap()
            .unwrap();
        assert_eq!((w.get(0, 3), w.bits(0, 3)), (0..6, 0b110));
        assert_eq!(w.columns(0, 3), vec![0, 1, 2, 3, 4, 5, 7, 8]);
        assert_eq!((w.get(0, 1), w.bits(0, 1), w.words()), (0..7, 0, 4));
        let cache = 6;
        let parents: Vec<Option<usize>> = (0..9)
            .map(|i: usize| i.checked_sub(1).map(|p| p / 3))
            .collect();
        let vis = pad_rows(&tree(cache, &parents), cache, 12);
        let cols = 24; // a fixed capacity past the 18 columns
        let iv = RowIntervals::tree_widened(&vis, cols, &Device::Cpu)
            .unwrap()
            .unwrap();
        let (hkv, g, n) = (2, 3, 12);
        let s = Tensor::arange(0f32, (hkv * g * n * cols) as f32, &Device::Cpu)
            .unwrap()
            .affine(0.37, 0.0)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((1, hkv, g * n, cols))
            .unwrap();
        let got = interval_softmax(&s, &iv, 0.7).unwrap();
        let mask = crate::layers::attention::mask_tensor_cols(&vis, cols, DType::F32, &Device::Cpu)
            .unwrap();
        let want = candle_nn::ops::softmax_last_dim(
            &(s * 0.7)
                .unwrap()
                .reshape((1, hkv, g, n, cols))
                .unwrap()
                .broadcast_add(&mask)
                .unwrap(),
        )
        .unwrap()
        .reshape((1, hkv, g * n, cols))
        .unwrap();
        assert!(crate::ops::compare::max_abs(&got, &want).unwrap() < 1e-6);
        // 70 nodes in a chain: the last rows see past their windows
        let chain: Vec<Option<usize>> = (0..70).map(|i: usize| i.checked_sub(1)).collect();
        let mut v = tree(0, &chain);
        v.set(69, 0, false); // row 69 sees 1..=69: its first run ends at 70, nothing past
        assert!(RowIntervals::tree_widened(&v, 70, &Device::Cpu)
            .unwrap()
            .is_some());
        v.set(69, 1, false); // now 2..=69 with column 0 hidden: still one run
        v.set(69, 5, false); // 2..5 and 6..=69: column 69 is 64 past the first run's end
        assert!(RowIntervals::tree_widened(&v, 70, &Device::Cpu)
            .unwrap()
            .is_none());
        assert!(RowIntervals::tree_widened(&docs, 8, &Device::Cpu).is_err());
    }

    /// Intervals given directly: the same table as from the visibilities, and a wrong count or
    /// an interval past the columns refused by name.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one row, one interval
    fn intervals_from_rows_equal_those_from_visibilities_and_check_their_bounds() {
        let masks = [right_aligned(2, 5, 1, 1), right_aligned(4, 5, 1, 1)];
        let a = RowIntervals::from_visibilities(&masks, &Device::Cpu)
            .unwrap()
            .unwrap();
        let b = RowIntervals::from_rows(&[3..6, 1..6], 2, 1, 6, &Device::Cpu).unwrap();
        assert_eq!(a.table.host, b.table.host);
        let e = RowIntervals::from_rows(&[3..6], 2, 1, 6, &Device::Cpu).unwrap_err();
        assert!(
            e.to_string().contains("1 key intervals for 2 sequences"),
            "{e}"
        );
        let e = RowIntervals::from_rows(&[3..7, 1..6], 2, 1, 6, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("does not lie in 6 columns"), "{e}");
    }
}

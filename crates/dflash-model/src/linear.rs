//! `x · Wᵀ` for every projection and the LM head, with a CPU kernel for few rows.
//!
//! Decoding on a CPU multiplies a handful of rows by each weight matrix: 1 row per AR step,
//! 16 per DFlash verify, 9 or 33 per DDTree verify. Reading the weights from memory is then
//! the whole cost, and it is the same for 1 row as for 16 if each weight row is read once and
//! used for every input row. candle's general matmul packs the weights first and costs 1.5–3×
//! more than that (docs/BENCHMARKS.md, seventh session: SmolLM2's AR step 53.6 → 32.0 ms).
//!
//! [`matmul_t`] therefore takes a direct path when `x` is an f32 CPU tensor of at most
//! [`FEW_ROWS`] rows that nothing differentiates (inference), `W` is contiguous f32, and the
//! CPU has AVX2 and FMA: chunks of weight rows are handed out to the calling thread and the
//! pool's threads; a chunk is computed in tiles of 4 input rows × 4 weight rows (AVX-512: 16
//! accumulators of 16 lanes; AVX2: 4 × 2 of 8 lanes), the weight rows staying in L1 while every
//! input row passes. Any other case (more rows, GPU, bf16, training with gradients) is candle's
//! matmul, unchanged.
//!
//! Example: SmolLM2's `up_proj` `W` `[1536, 576]` and 16 verify rows `x` `[16, 576]`: 16
//! chunks of 96 weight rows, each 24 tiles × 4 row groups; the result is `[16, 1536]`, equal to
//! candle's matmul within f32 rounding (the sums run in another order).

use candle_core::{DType, Device, Module, Result, Tensor};

/// The most rows the direct CPU path takes; more rows are candle's matmul (compute-bound).
pub const FEW_ROWS: usize = 32;

/// A projection `y = x · Wᵀ (+ b)`, `W` `[out, in]` as in the safetensors (`{name}.weight`).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = matmul_t(x, &self.weight)?;
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(b),
        }
    }
}

/// `x · Wᵀ` for `x` `[..., in]` and `W` `[out, in]` → `[..., out]`.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let (k, lead) = match dims.split_last() {
        Some((&k, lead)) => (k, lead),
        None => candle_core::bail!("matmul_t: a scalar input"),
    };
    let rows: usize = lead.iter().product();
    let mut out_shape = lead.to_vec();
    out_shape.push(w.dim(0)?);
    if few_rows_path(x, w, rows) {
        return few_rows_matmul(x, w, rows, k)?.reshape(out_shape);
    }
    // candle's matmul, the way candle_nn's Linear calls it
    if x.is_contiguous() && dims.len() > 2 {
        x.reshape((rows, k))?.matmul(&w.t()?)?.reshape(out_shape)
    } else {
        x.broadcast_matmul(&w.t()?)
    }
}

fn few_rows_path(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    matches!(x.device(), Device::Cpu)
        && rows <= FEW_ROWS
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.is_contiguous()
        && !x.track_op()
        && !w.track_op()
        && Kernel::best().is_some()
}

/// The direct path's instruction sets, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// 16 lanes, 32 registers: tiles of 4 input rows × 4 weight rows.
    Avx512,
    /// 8 lanes, 16 registers: tiles of 4 input rows × 2 weight rows.
    Avx2Fma,
}

impl Kernel {
    /// What this CPU runs (none: candle's matmul for every shape), detected once.
    fn best() -> Option<Kernel> {
        static BEST: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Self::available().first().copied())
    }

    fn available() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
            if avx2 && std::is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
            if avx2 {
                v.push(Kernel::Avx2Fma);
            }
        }
        v
    }
}

fn few_rows_matmul(x: &Tensor, w: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
    let n = w.dim(0)?;
    if w.dim(1)? != k {
        candle_core::bail!("matmul_t: input width {k} vs weight {:?}", w.dims());
    }
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (candle_core::Storage::Cpu(xc), candle_core::Storage::Cpu(wc)) = (&*xs, &*ws) else {
        candle_core::bail!("matmul_t: CPU tensors expected")
    };
    let xv = crate::kernel_io::cpu_slice::<f32>(xc, xl, "matmul_t input")?;
    let wv = crate::kernel_io::cpu_slice::<f32>(wc, wl, "matmul_t weight")?;
    let mut y = vec![0f32; rows * n];
    let Some(kernel) = Kernel::best() else {
        candle_core::bail!("matmul_t: this CPU has neither AVX-512 nor AVX2+FMA")
    };
    few_rows_into(kernel, xv, wv, rows, k, n, &mut y);
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// `y[rows, n] = x[rows, k] · w[n, k]ᵀ`, weight rows split over the thread pool.
fn few_rows_into(
    kernel: Kernel,
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
) {
    // chunks of weight rows, a multiple of 4 so that every chunk but the last is made of whole
    // tiles, handed out by a counter: the calling thread starts at once and the pool's threads
    // join as they wake (a wake-up costs ~10-20 µs; a 16-row up_proj ~300 µs)
    let threads = rayon::current_num_threads().max(1);
    let chunk = (n.div_ceil(threads * 8).max(16) + 3) & !3;
    let chunks = n.div_ceil(chunk);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = SyncPtr(y.as_mut_ptr());
    let drain = || loop {
        let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if c >= chunks {
            break;
        }
        let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(n));
        // writes go through the raw pointer, never a `&mut` over all of y: each chunk writes
        // only the columns j0..j1 of y, disjoint from the other chunks'; y outlives the scope
        let y = out.ptr();
        // SAFETY: `kernel` came from Kernel::available, which checked the CPU; y holds
        // rows × n values
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match kernel {
                Kernel::Avx512 => avx512::columns(x, w, rows, k, n, j0, j1, y),
                Kernel::Avx2Fma => avx2::columns(x, w, rows, k, n, j0, j1, y),
            }
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (kernel, x, w, k, j0, j1, y);
    };
    rayon::in_place_scope(|s| {
        for _ in 1..threads.min(chunks) {
            s.spawn(|_| drain());
        }
        drain();
    });
}

struct SyncPtr(*mut f32);
// SAFETY: tasks write disjoint columns (few_rows_into)
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// Through a method, so that closures capture the `Sync` wrapper, not the raw pointer.
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

/// The tiling of columns `j0..j1` shared by the kernels: tiles of 4 input rows × `J` weight
/// rows, the leftover input rows one at a time, then the leftover weight rows one at a time.
/// `tile(r, c, i, j)` computes `y[i..i+r, j..j+c]`. Example: 6 rows, columns 0..9, `J = 4`:
/// (4, 4, 0, 0), (1, 4, 4, 0), (1, 4, 5, 0), then the same at column 4, then (4, 1, 0, 8),
/// (1, 1, 4, 8), (1, 1, 5, 8).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn tiles<const J: usize>(
    rows: usize,
    j0: usize,
    j1: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut j = j0;
    while j < j1 {
        let c = if j + J <= j1 { J } else { 1 };
        let mut i = 0;
        while i < rows {
            let r = if i + 4 <= rows { 4 } else { 1 };
            tile(r, c, i, j);
            i += r;
        }
        j += c;
    }
}

/// `pub unsafe fn columns(x, w, rows, k, n, j0, j1, y)` of a kernel module: columns `j0..j1`
/// of `y` (all rows) in the tiles of [`tiles`] with `$j` weight rows, each computed by the
/// module's `tile::<R, J>` (compiled for `$feature`).
#[cfg(target_arch = "x86_64")]
macro_rules! columns_over_tiles {
    ($j:literal, $feature:literal) => {
        #[target_feature(enable = $feature)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn columns(
            x: &[f32],
            w: &[f32],
            rows: usize,
            k: usize,
            n: usize,
            j0: usize,
            j1: usize,
            y: *mut f32,
        ) {
            super::tiles::<$j>(rows, j0, j1, |r, c, i, j| match (r, c) {
                (4, $j) => tile::<4, $j>(x, w, k, n, i, j, y),
                (4, _) => tile::<4, 1>(x, w, k, n, i, j, y),
                (_, $j) => tile::<1, $j>(x, w, k, n, i, j, y),
                _ => tile::<1, 1>(x, w, k, n, i, j, y),
            });
        }
    };
}
#[cfg(target_arch = "x86_64")]
use columns_over_tiles;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    super::columns_over_tiles!(2, "avx2,fma");

    /// `y[i0..i0+R, j0..j0+J]`: R input rows against J weight rows, 8 lanes at a time, the
    /// tail of `k` (k mod 8) in scalar.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const J: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        n: usize,
        i0: usize,
        j0: usize,
        y: *mut f32,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); J]; R];
        let k8 = k - k % 8;
        let mut kk = 0;
        while kk < k8 {
            let mut wv = [_mm256_setzero_ps(); J];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(wp.add((j0 + c) * k + kk));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp.add((i0 + r) * k + kk));
                for c in 0..J {
                    a[c] = _mm256_fmadd_ps(xv, wv[c], a[c]);
                }
            }
            kk += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            for c in 0..J {
                let mut s = hsum(a[c]);
                for t in k8..k {
                    s += x[(i0 + r) * k + t] * w[(j0 + c) * k + t];
                }
                *y.add((i0 + r) * n + j0 + c) = s;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    super::columns_over_tiles!(4, "avx512f");

    /// `y[i0..i0+R, j0..j0+J]`, 16 lanes at a time, the tail of `k` (k mod 16) masked.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const R: usize, const J: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        n: usize,
        i0: usize,
        j0: usize,
        y: *mut f32,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let mut kk = 0;
        while kk < k {
            let m: __mmask16 = if k - kk >= 16 {
                0xffff
            } else {
                (1u16 << (k - kk)) - 1
            };
            let mut wv = [_mm512_setzero_ps(); J];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(m, wp.add((j0 + c) * k + kk));
                // the same line of the next tile's weight row, so that it comes from memory
                // while this tile computes (a hint: past the end it fetches nothing useful)
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add((j0 + J + c) * k + kk) as *const i8);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(m, xp.add((i0 + r) * k + kk));
                for c in 0..J {
                    a[c] = _mm512_fmadd_ps(xv, wv[c], a[c]);
                }
            }
            kk += 16;
        }
        for (r, a) in acc.iter().enumerate() {
            let row = (i0 + r) * n + j0;
            if J == 4 {
                let s = sum4(a[0], a[1], a[2], a[3]);
                _mm_storeu_ps(y.add(row), s);
            } else {
                for (c, v) in a.iter().enumerate() {
                    *y.add(row + c) = _mm512_reduce_add_ps(*v);
                }
            }
        }
    }

    /// The four sums `[Σa, Σb, Σc, Σd]` of four vectors in one pass (with k = 576 the four
    /// separate reductions cost a third of a tile's FMAs).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
        // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
        let ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        let cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        // per lane: [Σa, Σb, Σc, Σd] of that lane's four elements
        let s = _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(ab, cd),
            _mm512_shuffle_ps::<0b11_10_11_10>(ab, cd),
        );
        // the four lanes
        let lo = _mm_add_ps(
            _mm512_extractf32x4_ps::<0>(s),
            _mm512_extractf32x4_ps::<1>(s),
        );
        let hi = _mm_add_ps(
            _mm512_extractf32x4_ps::<2>(s),
            _mm512_extractf32x4_ps::<3>(s),
        );
        _mm_add_ps(lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &Tensor, w: &Tensor) -> Tensor {
        let k = w.dim(1).unwrap();
        let lead = x.dims()[..x.rank() - 1].to_vec();
        let rows: usize = lead.iter().product();
        let y = x
            .reshape((rows, k))
            .unwrap()
            .matmul(&w.t().unwrap())
            .unwrap();
        let mut shape = lead;
        shape.push(w.dim(0).unwrap());
        y.reshape(shape).unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The direct path = candle's matmul for every tile shape and every kernel this CPU has:
    /// rows 1..=33 (tiles of 4, the rest single rows; 33 is over the limit), weight rows not a
    /// multiple of 4 (leftover columns), and widths not a multiple of 8 or 16 (the tails).
    #[test]
    fn few_rows_equal_candles_matmul() {
        let dev = Device::Cpu;
        for &(n, k) in &[(37usize, 21usize), (64, 576), (5, 8)] {
            let w = Tensor::randn(0f32, 1., (n, k), &dev).unwrap();
            for rows in [1usize, 2, 3, 4, 5, 7, 16, 32, 33] {
                let x = Tensor::randn(0f32, 1., (1, rows, k), &dev).unwrap();
                let direct = rows <= FEW_ROWS && Kernel::best().is_some();
                assert_eq!(few_rows_path(&x, &w, rows), direct);
                let want = reference(&x, &w);
                let got = matmul_t(&x, &w).unwrap();
                assert_eq!(got.dims(), &[1, rows, n]);
                let tol = 1e-4 * (k as f32).sqrt();
                assert!(max_diff(&got, &want) < tol, "n {n} k {k} rows {rows}");
                // every kernel this CPU has, not only the one matmul_t picks
                let (xv, wv) = (flat(&x), flat(&w));
                for kernel in Kernel::available() {
                    let mut y = vec![0f32; rows * n];
                    few_rows_into(kernel, &xv, &wv, rows, k, n, &mut y);
                    let got = Tensor::from_vec(y, (1, rows, n), &dev).unwrap();
                    let err = max_diff(&got, &want);
                    assert!(err < tol, "{kernel:?} n {n} k {k} rows {rows}: {err}");
                }
            }
        }
    }

    /// Gradients still flow: a tracked input takes candle's matmul.
    #[test]
    fn tracked_inputs_take_candles_matmul() {
        let dev = Device::Cpu;
        let w = candle_core::Var::randn(0f32, 1., (6, 8), &dev).unwrap();
        let x = Tensor::randn(0f32, 1., (2, 8), &dev).unwrap();
        assert!(!few_rows_path(&x, w.as_tensor(), 2));
        let g = matmul_t(&x, w.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dw = g.get(w.as_tensor()).unwrap();
        // d/dW of Σ x·Wᵀ = column sums of x, for every weight row
        let want = x.sum_keepdim(0).unwrap().broadcast_as((6, 8)).unwrap();
        let err = (dw - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(err.to_scalar::<f32>().unwrap() < 1e-5);
    }

    /// A non-contiguous input (a narrow of the middle columns) is made contiguous first.
    #[test]
    fn strided_input() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (9, 16), &dev).unwrap();
        let big = Tensor::randn(0f32, 1., (3, 20), &dev).unwrap();
        let x = big.narrow(1, 2, 16).unwrap();
        let err = (matmul_t(&x, &w).unwrap() - reference(&x.contiguous().unwrap(), &w))
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(err.to_scalar::<f32>().unwrap() < 1e-4);
    }
}

//! The direct path of [`super::matmul_t`] for a few f32 rows on an AVX2 + FMA CPU without the
//! panels' ISA: tiles of 4 input rows × 2 weight rows over the `[out, in]` layout.

use std::sync::OnceLock;

use candle_core::{DType, Device, Result, Tensor};

use super::FEW_ROWS;
use crate::cpu::panels::SyncPtr;

pub(super) fn few_rows_path(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    matches!(x.device(), Device::Cpu)
        && rows <= FEW_ROWS
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.is_contiguous()
        && !x.track_op()
        && !w.track_op()
        && avx2_fma()
}

/// Whether this CPU has AVX2 and FMA (the direct path of [`matmul_t`]), detected once.
pub(super) fn avx2_fma() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

pub(super) fn few_rows_matmul(x: &Tensor, w: &Tensor, rows: usize, k: usize) -> Result<Tensor> {
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
    let xv = crate::ops::kernel_io::cpu_slice::<f32>(xc, xl, "matmul_t input")?;
    let wv = crate::ops::kernel_io::cpu_slice::<f32>(wc, wl, "matmul_t weight")?;
    let mut y = vec![0f32; rows * n];
    if !avx2_fma() {
        candle_core::bail!("matmul_t: this CPU lacks AVX2+FMA")
    }
    few_rows_into(xv, wv, rows, k, n, &mut y);
    Tensor::from_vec(y, (rows, n), &Device::Cpu)
}

/// `y[rows, n] = x[rows, k] · w[n, k]ᵀ`, weight rows split over [`crate::cpu::helpers`].
fn few_rows_into(x: &[f32], w: &[f32], rows: usize, k: usize, n: usize, y: &mut [f32]) {
    // chunks of weight rows, a multiple of 4 so that every chunk but the last is made of whole
    // tiles, on the calling thread and crate::cpu::helpers (as Panels::matmul)
    let chunk = 16;
    let out = SyncPtr(y.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        // writes go through the raw pointer, never a `&mut` over all of y: each chunk writes
        // only the columns j0..j1 of y, disjoint from the other chunks'; y outlives the call
        let y = out.ptr();
        let (j0, j1) = (range.start * chunk, (range.end * chunk).min(n));
        // SAFETY: callers checked avx2_fma(); y holds rows × n values
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx2::columns(x, w, rows, k, n, j0, j1, y)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (x, w, k, j0, j1, y);
    };
    if rows * n * k < crate::cpu::panels::INLINE_FMAS {
        run(0..n.div_ceil(chunk));
    } else {
        crate::cpu::helpers::for_each_chunk(n.div_ceil(chunk), &|c| run(c..c + 1));
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

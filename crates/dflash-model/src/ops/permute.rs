//! Permuted (and plain) contiguous copies of strided views in one kernel, with a written
//! backward: the inverse permutation, one kernel.
//!
//! Attention moves heads between the projection layout `[1, rows, heads, d]` and the matmul
//! layout `[1, heads, rows, d]`; candle's strided copy walks each value's coordinates in 64-bit
//! divisions, which makes a head transpose many times slower than a plain copy (the kernel
//! profile of a training step in `docs/BENCHMARKS.md`). The kernel here divides in 32 bits over
//! at most 6 dimensions. On the CPU (and for other dtypes,
//! ranks or sizes) [`permuted`] is candle's `permute` then `contiguous`, so CPU results are
//! unchanged; the CPU twin of the kernel (the same index walk) is what `check device` compares.
//! Example: `x = [[1, 2, 3], [4, 5, 6]]`, `permuted(x, [1, 0])` → `[[1, 4], [2, 5], [3, 6]]`;
//! the gradient `g` of that comes back as `gᵀ`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// The most dimensions the kernel takes.
pub const MAX_RANK: usize = 6;

/// Whether the kernel serves `t`: on a GPU, f32 or bf16, at most [`MAX_RANK`] dimensions, every
/// index within `i32`.
pub fn serves(t: &Tensor) -> bool {
    let l = t.layout();
    let reach = l.start_offset()
        + l.dims()
            .iter()
            .zip(l.stride())
            .map(|(&d, &s)| d.saturating_sub(1) * s)
            .sum::<usize>();
    !t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::BF16)
        && t.rank() <= MAX_RANK
        && t.elem_count() < i32::MAX as usize
        && reach < i32::MAX as usize
}

/// `t.permute(perm)` as a fresh contiguous tensor: the kernel where it [`serves`] (with the
/// inverse permutation as its backward), else candle's `permute` and `contiguous`.
pub fn permuted(t: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let mut seen = perm.to_vec();
    seen.sort_unstable();
    if perm.len() != t.rank() || seen.iter().enumerate().any(|(i, &p)| i != p) {
        candle_core::bail!(
            "permuted: {perm:?} is not a permutation of the {} dimensions of {:?}",
            t.rank(),
            t.dims()
        );
    }
    if !serves(t) {
        return t.permute(perm)?.contiguous();
    }
    t.apply_op1(Permute {
        perm: perm.to_vec(),
    })
}

/// Dimensions 1 and 2 swapped, `[b, rows, heads, d]` ↔ `[b, heads, rows, d]` (attention's
/// projection and matmul layouts, both ways): on a GPU where the kernel [`serves`], a
/// contiguous copy (with its backward); elsewhere candle's transposed view, no copy (its
/// consumers copy where they must, as they did). Example: q of 8,192 rows × 32 heads × 128 at
/// the Qwen3-8B training shape → `[1, 32, 8192, 128]`.
pub fn swap_rows_heads(t: &Tensor) -> Result<Tensor> {
    if serves(t) && t.rank() == 4 {
        permuted(t, &[0, 2, 1, 3])
    } else {
        t.transpose(1, 2)
    }
}

/// `t` contiguous: itself when it is, else a copy (the kernel where it [`serves`]).
pub fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    permuted(t, &(0..t.rank()).collect::<Vec<_>>())
}

/// The permuted copy on any device: the kernel on a GPU, its twin on the CPU (the check's
/// reference; [`permuted`] is what models call).
pub fn permuted_twin(t: &Tensor, perm: &[usize]) -> Result<Tensor> {
    t.apply_op1(Permute {
        perm: perm.to_vec(),
    })
}

struct Permute {
    perm: Vec<usize>,
}

/// The view after the permutation: dims, strides (innermost last) and start offset.
fn view_of(l: &Layout, perm: &[usize]) -> Result<Layout> {
    let p = l.permute(perm)?;
    if p.dims().len() > MAX_RANK {
        candle_core::bail!(
            "permuted: {} dimensions (at most {MAX_RANK})",
            p.dims().len()
        );
    }
    Ok(p)
}

/// The source offset of output value `i`: the kernel's index walk.
fn source_offset(i: usize, v: &Layout) -> usize {
    let (mut r, mut o) = (i, v.start_offset());
    for (&d, &s) in v.dims().iter().zip(v.stride()).rev() {
        o += (r % d) * s;
        r /= d;
    }
    o
}

/// A view's walk over whole vectors of `lanes` values: `(offset, dims, strides)` counted in
/// vectors, when the innermost dimension is contiguous (stride 1) and a multiple of `lanes`, and
/// the offset and every other stride (of a dimension longer than 1) are multiples of `lanes`, so
/// that each vector of the output is one aligned vector of the source. Example: a `[1, 8192,
/// 32, 128]` transpose of a bf16 `[1, 32, 8192, 128]` (strides `[.., 128, 1048576, 1]`) in
/// vectors of 8: dims `[1, 8192, 32, 16]`, strides `[.., 16, 131072, 1]`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn in_vectors(
    offset: usize,
    dims: &[usize],
    strides: &[usize],
    lanes: usize,
) -> Option<(usize, Vec<usize>, Vec<usize>)> {
    let (&last, lead) = dims.split_last()?;
    let whole = |s: usize, d: usize| d == 1 || s.is_multiple_of(lanes);
    let fits = lanes > 1
        && strides.last() == Some(&1)
        && last.is_multiple_of(lanes)
        && offset.is_multiple_of(lanes)
        && lead.iter().zip(strides).all(|(&d, &s)| whole(s, d));
    if !fits {
        return None;
    }
    let mut d = dims.to_vec();
    *d.last_mut()? = last / lanes;
    let mut st: Vec<usize> = strides.iter().map(|&s| s / lanes).collect();
    *st.last_mut()? = 1;
    Some((offset / lanes, d, st))
}

fn gather<T: Copy>(src: &[T], v: &Layout) -> Vec<T> {
    (0..v.shape().elem_count())
        .map(|i| src[source_offset(i, v)])
        .collect()
}

/// The kernel's argument: rank, offset, dims and strides (innermost last).
#[cfg(feature = "cuda")]
#[repr(C)]
#[derive(Clone, Copy)]
struct Strided6 {
    rank: i32,
    offset: i32,
    dims: [i32; MAX_RANK],
    strides: [i32; MAX_RANK],
}

// SAFETY: a plain `#[repr(C)]` struct of i32s, laid out as `Strided6` in src/ops/permute.cu.
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for Strided6 {}

impl CustomOp1 for Permute {
    fn name(&self) -> &'static str {
        "permute-copy"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = view_of(l, &self.perm)?;
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(gather(x, &v)),
            CpuStorage::BF16(x) => CpuStorage::BF16(gather(x, &v)),
            CpuStorage::F16(x) => CpuStorage::F16(gather(x, &v)),
            CpuStorage::U32(x) => CpuStorage::U32(gather(x, &v)),
            other => candle_core::bail!("permuted: {:?} is not supported", other.dtype()),
        };
        Ok((out, v.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, by_float, elementwise, launch};
        let v = view_of(l, &self.perm)?;
        let n = v.shape().elem_count();
        // whole 16-byte vectors where the layout allows: the walk then counts vectors
        let lanes = 16 / s.dtype().size_in_bytes();
        let (walk, unit) = match in_vectors(v.start_offset(), v.dims(), v.stride(), lanes) {
            Some(w) => (w, lanes),
            None => (
                (v.start_offset(), v.dims().to_vec(), v.stride().to_vec()),
                1,
            ),
        };
        let mut sh = Strided6 {
            rank: walk.1.len() as i32,
            offset: walk.0 as i32,
            dims: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        for (k, (&d, &st)) in walk.1.iter().zip(&walk.2).enumerate() {
            sh.dims[k] = d as i32;
            sh.strides[k] = st as i32;
        }
        let dev = s.device().clone();
        let cfg = elementwise((n / unit) as u64);
        let nn = (n / unit) as u32;
        let name = if unit > 1 {
            "strided_copy_v16"
        } else {
            "strided_copy"
        };
        let out = by_float!(s.dtype(), "permuted", |T, dt| {
            let src = s.as_cuda_slice::<T>()?;
            let src = src.slice(0..src.len());
            let dst = alloc::<T>(&dev, n)?;
            launch!(dev, name, dt, cfg, src, dst, nn, sh);
            candle_core::CudaStorage::wrap_cuda_slice(dst, dev)
        });
        Ok((out, v.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut inv = vec![0; self.perm.len()];
        for (i, &p) in self.perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(Some(permuted(&grad.detach(), &inv)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The kernel's vector walk reads the same source values, in the same order, as the walk
    /// over values: head transposes of narrowed views (an offset, gaps), in vectors of 8 and 4;
    /// and layouts whose vectors would straddle or misalign are refused.
    #[test]
    fn the_vector_walk_reads_what_the_value_walk_reads() {
        for (dims, perm, narrow, lanes) in [
            (
                vec![2usize, 6, 3, 16],
                vec![0usize, 2, 1, 3],
                (1usize, 1usize, 4usize),
                8usize,
            ),
            (vec![1, 5, 4, 32], vec![0, 2, 1, 3], (2, 1, 3), 4),
            (vec![3, 4, 24], vec![1, 0, 2], (0, 1, 2), 8),
        ] {
            let n: usize = dims.iter().product();
            let t = Tensor::arange(0u32, n as u32, &Device::Cpu)
                .unwrap()
                .reshape(dims.as_slice())
                .unwrap()
                .narrow(narrow.0, narrow.1, narrow.2)
                .unwrap();
            let v = view_of(t.layout(), &perm).unwrap();
            let by_value: Vec<usize> = (0..v.shape().elem_count())
                .map(|i| source_offset(i, &v))
                .collect();
            let (off, d, st) = in_vectors(v.start_offset(), v.dims(), v.stride(), lanes)
                .unwrap_or_else(|| panic!("{dims:?} {perm:?}: no vector walk"));
            let vl = Layout::new(d.as_slice().into(), st, off);
            let by_vector: Vec<usize> = (0..vl.shape().elem_count())
                .flat_map(|i| {
                    let o = source_offset(i, &vl) * lanes;
                    o..o + lanes
                })
                .collect();
            assert_eq!(by_vector, by_value, "{dims:?} {perm:?}");
        }
        // an innermost dim of 7, an offset of 3, a stride of 12 in vectors of 8: refused
        assert!(in_vectors(0, &[4, 7], &[7, 1], 4).is_none());
        assert!(in_vectors(3, &[4, 8], &[8, 1], 8).is_none());
        assert!(in_vectors(0, &[4, 8], &[12, 1], 8).is_none());
        assert!(in_vectors(0, &[4, 8], &[1, 4], 8).is_none());
    }

    #[test]
    fn the_docs_example() {
        let x = Var::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu).unwrap();
        let y = permuted_twin(x.as_tensor(), &[1, 0]).unwrap();
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            vec![vec![1., 4.], vec![2., 5.], vec![3., 6.]]
        );
        let w = Tensor::new(&[[1f32, 10.], [100., 1000.], [1e4, 1e5]], &Device::Cpu).unwrap();
        let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(
            g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![1., 100., 1e4], vec![10., 1000., 1e5]]
        );
    }

    /// The twin equals candle's permute and copy on views with an offset and gaps (a narrow of
    /// a transposed 5-D tensor), for several permutations, and its gradient equals candle's.
    #[test]
    fn equals_candles_permute_and_copy() {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, (2 * 3 * 5 * 4 * 6) as f32, &dev)
            .unwrap()
            .reshape((2, 3, 5, 4, 6))
            .unwrap();
        let view = base.transpose(1, 2).unwrap().narrow(1, 1, 3).unwrap(); // [2, 3, 3, 4, 6]
        for perm in [
            [0, 1, 2, 3, 4],
            [0, 2, 1, 3, 4],
            [4, 3, 2, 1, 0],
            [1, 0, 3, 2, 4],
        ] {
            let want = view.permute(perm.to_vec()).unwrap().contiguous().unwrap();
            let got = permuted_twin(&view, &perm).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert_eq!(
                crate::ops::compare::max_abs(&got, &want).unwrap(),
                0.0,
                "{perm:?}"
            );
            // through `permuted` (candle's path on the CPU) too
            let p = permuted(&view, &perm).unwrap();
            assert_eq!(crate::ops::compare::max_abs(&p, &want).unwrap(), 0.0);
        }
        // gradients: a weighted sum through the twin and through candle's ops
        let x0 = Tensor::arange(0f32, 60., &dev)
            .unwrap()
            .reshape((3, 4, 5))
            .unwrap();
        let w = Tensor::arange(0f32, 60., &dev)
            .unwrap()
            .sin()
            .unwrap()
            .reshape((5, 3, 4))
            .unwrap();
        let grad = |twin: bool| {
            let x = Var::from_tensor(&x0).unwrap();
            let y = if twin {
                permuted_twin(x.as_tensor(), &[2, 0, 1]).unwrap()
            } else {
                x.as_tensor()
                    .permute((2, 0, 1))
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(x.as_tensor()).unwrap().clone()
        };
        let e = crate::ops::compare::max_abs(&grad(true), &grad(false)).unwrap();
        assert_eq!(e, 0.0);
    }

    #[test]
    fn a_bad_permutation_is_named() {
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        for bad in [vec![0], vec![0, 0], vec![1, 2]] {
            let e = permuted(&x, &bad).unwrap_err().to_string();
            assert!(e.contains("is not a permutation"), "{e}");
        }
        assert!(!serves(&x), "the CPU keeps candle's copy");
        let c = contiguous(&x).unwrap();
        assert!(c.is_contiguous());
    }
}

//! Permuted (and plain) contiguous copies of strided views in one kernel, with a written
//! backward: the inverse permutation, one kernel.
//!
//! Attention moves heads between the projection layout `[1, rows, heads, d]` and the matmul
//! layout `[1, heads, rows, d]`; candle's strided copy walks each value's coordinates in 64-bit
//! divisions, ≈ 0.45 ms for one 64 MB head transpose on the H200 at the Qwen3-8B training shape
//! (`docs/BENCHMARKS.md`, the kernel profile of a training step), ten times a plain copy. The
//! kernel here divides in 32 bits over at most 6 dimensions. On the CPU (and for other dtypes,
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

// SAFETY: a plain `#[repr(C)]` struct of i32s, laid out as `Strided6` in src/cuda/fused.cu.
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
        let mut sh = Strided6 {
            rank: v.dims().len() as i32,
            offset: v.start_offset() as i32,
            dims: [1; MAX_RANK],
            strides: [0; MAX_RANK],
        };
        for (k, (&d, &st)) in v.dims().iter().zip(v.stride()).enumerate() {
            sh.dims[k] = d as i32;
            sh.strides[k] = st as i32;
        }
        let dev = s.device().clone();
        let cfg = elementwise(n as u64);
        let nn = n as u32;
        let out = by_float!(s.dtype(), "permuted", |T, dt| {
            let src = s.as_cuda_slice::<T>()?;
            let src = src.slice(0..src.len());
            let dst = alloc::<T>(&dev, n)?;
            launch!(dev, "strided_copy", dt, cfg, src, dst, nn, sh);
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

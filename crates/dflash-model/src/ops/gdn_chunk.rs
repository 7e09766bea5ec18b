//! The gated delta rule over a prefill's chain of rows, chunked: the algorithm of
//! transformers' `torch_chunk_gated_delta_rule` (chunk 64, the WY form): two CUDA kernels per
//! layer on a GPU (f32 FMAs, or TF32 tensor cores for a bf16 model: [`ChunkMath`]), for one
//! sequence or many at once ([`gdn_chunked_seqs`], a batched prefill), its CPU twin
//! ([`chunked_host`]) on the CPU. The recurrent form
//! ([`crate::ops::gdn_recurrence`]) walks the rows one by one; this one walks chunks of 64
//! and does the work inside a chunk as small matrix products, which is what makes a long
//! prefill (the training features of a 2,048-token row) fast on a GPU.
//!
//! Per value head h, chunk rows t = 1..L (L ≤ 64) from the state S₀ ∈ R^{dk×dv} before the
//! chunk, with cᵢ = g₁ + … + gᵢ (the in-chunk cumulative log-decay):
//! - `A[i][j] = βᵢ (kᵢ·kⱼ) e^{cᵢ−cⱼ}` for j < i, and `T = (I + A)⁻¹` (unit lower triangular);
//! - `X = T·(β v)`, `Y = T·(β e^{c} k)`, the chunk's new values `v' = X − Y·S₀`;
//! - `oᵢ = e^{cᵢ} S₀ᵀqᵢ + Σ_{j≤i} (qᵢ·kⱼ) e^{cᵢ−cⱼ} v'ⱼ`;
//! - `S = e^{c_L} S₀ + Σⱼ e^{c_L−cⱼ} kⱼ v'ⱼᵀ`.
//!
//! This equals the recurrence `S ← S·e^{g}; δ = (v − Sᵀk)·β; S ← S + k δᵀ; o = Sᵀq` row by
//! row up to rounding (f32: ≈ 1e-6 relative; `chunked_equals_the_recurrence`). Example: a
//! 150-row prefill is chunks of 64, 64 and 22 rows; only the state after row 150 comes back,
//! so a chunked forward is never rolled back into (a prefill never is).
//!
//! # Shapes
//! - `rows` `[n, 2·Hk·dk + Hv·dv + 2·Hv]` f32: q (L2-normalised and scaled) | k | v | β | g,
//!   as [`crate::ops::gdn_recurrence`]'s;
//! - `init` `[Hv·dk·dv]` f32, the state before the first row;
//! - out: `o` `[n, Hv·dv]` and the state after the last row `[1, Hv·dk·dv]`.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::ops::gdn_recurrence::RecurrenceDims;
use crate::ops::kernel_io::cpu_slice;

/// Rows per chunk.
pub const CHUNK: usize = 64;

/// How a GPU computes the chunk's block products (the CPU twin is f32 either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkMath {
    /// f32 FMAs (`gdn_chunk.cu`): a model that computes in f32, equal to the CPU twin up to
    /// f32 rounding.
    F32,
    /// TF32 tensor-core MMAs with f32 sums and state (`gdn_chunk_tc.cu`): a model in bf16 or
    /// f16, whose rows were rounded to 8–11 bits of mantissa already. Head sizes the kernels
    /// do not take ([`tc_supported`]) run the f32 kernels.
    Tf32,
}

impl ChunkMath {
    /// The math for a model computing in `dtype`: TF32 products unless it is f32.
    pub fn for_dtype(dtype: DType) -> Self {
        if dtype == DType::F32 {
            Self::F32
        } else {
            Self::Tf32
        }
    }
}

/// The chunked rule over a chain of `rows` from `init` (see the module doc):
/// `(o [n, Hv·dv], state [1, Hv·dk·dv])`.
pub fn gdn_chunked(
    rows: &Tensor,
    init: &Tensor,
    dims: RecurrenceDims,
    math: ChunkMath,
) -> Result<(Tensor, Tensor)> {
    let n = rows.dim(0)?;
    gdn_chunked_seqs(rows, init, &[n], dims, math)
}

/// The chunked rule over several independent chains at once (a batched prefill), one launch
/// of each kernel for all: sequence s is the next `lens[s]` rows of `rows`, from its state
/// `init[s]` (`init` `[b, Hv·dk·dv]` or flat): `(o [Σ lens, Hv·dv], states [b, Hv·dk·dv])`,
/// each sequence's as [`gdn_chunked`] alone gives it. Example: lens [150, 64] → rows 0..150
/// from init[0] in chunks of 64 + 64 + 22, rows 150..214 from init[1] in one chunk.
pub fn gdn_chunked_seqs(
    rows: &Tensor,
    init: &Tensor,
    lens: &[usize],
    dims: RecurrenceDims,
    math: ChunkMath,
) -> Result<(Tensor, Tensor)> {
    let (n, w) = rows.dims2()?;
    let b = lens.len();
    if w != dims.row_len()
        || init.elem_count() != b * dims.state_len()
        || lens.contains(&0)
        || lens.iter().sum::<usize>() != n
        || b == 0
    {
        candle_core::bail!(
            "gdn chunked: rows {:?} / states {:?} do not fit non-empty chains of {lens:?} rows of {dims:?}",
            rows.dims(),
            init.dims()
        );
    }
    let out = rows.to_dtype(DType::F32)?.contiguous()?.apply_op2_no_bwd(
        &init.to_dtype(DType::F32)?.flatten_all()?.contiguous()?,
        &Chunked {
            dims,
            math,
            lens: lens.to_vec(),
        },
    )?;
    let vd = dims.hv * dims.dv;
    let o = out.narrow(0, 0, n * vd)?.reshape((n, vd))?;
    let s = out
        .narrow(0, n * vd, b * dims.state_len())?
        .reshape((b, dims.state_len()))?;
    Ok((o, s))
}

/// The CPU twin, in f32: `(o, state)` flat. The order of every sum is the one transformers'
/// `torch_chunk_gated_delta_rule` writes (X and Y by forward substitution, row after row).
pub fn chunked_host(
    d: RecurrenceDims,
    rows: &[f32],
    init: &[f32],
    n: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (kd, vd, dk, dv, w) = (d.hk * d.dk, d.hv * d.dv, d.dk, d.dv, d.row_len());
    let group = d.hv / d.hk;
    let mut out = vec![0f32; n * vd];
    let mut state = init.to_vec();
    for h in 0..d.hv {
        let kh = h / group;
        let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
        let row = |t: usize| &rows[t * w..(t + 1) * w];
        let qr = |t: usize| &row(t)[kh * dk..(kh + 1) * dk];
        let kr = |t: usize| &row(t)[kd + kh * dk..kd + (kh + 1) * dk];
        let vr = |t: usize| &row(t)[2 * kd + h * dv..2 * kd + (h + 1) * dv];
        let beta = |t: usize| row(t)[2 * kd + vd + h];
        let g = |t: usize| row(t)[2 * kd + vd + d.hv + h];
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
        for c0 in (0..n).step_by(CHUNK) {
            let l = CHUNK.min(n - c0);
            let t = |i: usize| c0 + i;
            let mut cum = vec![0f32; l];
            let mut acc = 0f32;
            for (i, cm) in cum.iter_mut().enumerate() {
                acc += g(t(i));
                *cm = acc;
            }
            let bt = |i: usize| beta(t(i));
            // A[i][j] = β_i (k_i·k_j) e^{cum_i - cum_j}, j < i; solve (I + A) X = β v and
            // (I + A) Y = β k e^{cum} by forward substitution
            let mut x = vec![vec![0f32; dv]; l];
            let mut y = vec![vec![0f32; dk]; l];
            for i in 0..l {
                let mut xi: Vec<f32> = vr(t(i)).iter().map(|a| a * bt(i)).collect();
                let e = cum[i].exp();
                let mut yi: Vec<f32> = kr(t(i)).iter().map(|a| a * bt(i) * e).collect();
                for j in 0..i {
                    let aij = bt(i) * dot(kr(t(i)), kr(t(j))) * (cum[i] - cum[j]).exp();
                    for (u, w) in xi.iter_mut().zip(&x[j]) {
                        *u -= aij * w;
                    }
                    for (u, w) in yi.iter_mut().zip(&y[j]) {
                        *u -= aij * w;
                    }
                }
                x[i] = xi;
                y[i] = yi;
            }
            // v_new = X - Y S
            let vnew: Vec<Vec<f32>> = (0..l)
                .map(|i| {
                    (0..dv)
                        .map(|jv| x[i][jv] - (0..dk).map(|a| y[i][a] * s[a * dv + jv]).sum::<f32>())
                        .collect()
                })
                .collect();
            for i in 0..l {
                let e = cum[i].exp();
                for jv in 0..dv {
                    let inter: f32 = (0..dk).map(|a| qr(t(i))[a] * e * s[a * dv + jv]).sum();
                    let intra: f32 = (0..=i)
                        .map(|j| dot(qr(t(i)), kr(t(j))) * (cum[i] - cum[j]).exp() * vnew[j][jv])
                        .sum();
                    out[t(i) * vd + h * dv + jv] = inter + intra;
                }
            }
            let last = cum[l - 1];
            let el = last.exp();
            s.iter_mut().for_each(|w| *w *= el);
            for (j, vj) in vnew.iter().enumerate() {
                let f = (last - cum[j]).exp();
                for a in 0..dk {
                    let ka = kr(t(j))[a] * f;
                    for jv in 0..dv {
                        s[a * dv + jv] += ka * vj[jv];
                    }
                }
            }
        }
    }
    (out, state)
}

/// Whether the CUDA kernels take these head sizes (the CPU twin takes any): dk ≤ 128 and
/// dv ≤ 256, both multiples of 4 (16-byte rows in shared memory).
pub fn cuda_supported(d: RecurrenceDims) -> bool {
    d.dk <= 128 && d.dv <= 256 && d.dk.is_multiple_of(4) && d.dv.is_multiple_of(4)
}

/// Whether the tensor-core kernels take these head sizes: dk ≤ 128 a multiple of 16 (the
/// MMA tiles), dv ≤ 256 a multiple of 32 (a scan block's columns).
pub fn tc_supported(d: RecurrenceDims) -> bool {
    d.dk <= 128 && d.dv <= 256 && d.dk.is_multiple_of(16) && d.dv.is_multiple_of(32)
}

/// Whether `math` runs on the tensor-core kernels at these head sizes (those it does not take
/// run the f32 kernels). Example: the Qwen3.6-27B layer (dk = dv = 128) in `Tf32` → yes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn on_tensor_cores(math: ChunkMath, d: RecurrenceDims) -> bool {
    math == ChunkMath::Tf32 && tc_supported(d)
}

struct Chunked {
    dims: RecurrenceDims,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    math: ChunkMath,
    /// Each sequence's rows, in order.
    lens: Vec<usize>,
}

impl Chunked {
    fn out_len(&self, n: usize) -> usize {
        n * self.dims.hv * self.dims.dv + self.lens.len() * self.dims.state_len()
    }
}

/// The kernels' sequence table: each sequence's first row then the total, each one's first
/// chunk then the total (`2·(b + 1)` values). Example: lens [150, 64] → [0, 150, 214, 0, 3, 4].
pub fn seq_table(lens: &[usize]) -> Vec<u32> {
    let mut rows = vec![0u32];
    let mut chunks = vec![0u32];
    for &l in lens {
        rows.push(rows[rows.len() - 1] + l as u32);
        chunks.push(chunks[chunks.len() - 1] + l.div_ceil(CHUNK) as u32);
    }
    rows.extend(chunks);
    rows
}

impl CustomOp2 for Chunked {
    fn name(&self) -> &'static str {
        "gdn-chunked"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let rows = cpu_slice::<f32>(s1, l1, "gdn rows")?;
        let init = cpu_slice::<f32>(s2, l2, "gdn state")?;
        let n = l1.shape().dims()[0];
        let (w, sl) = (self.dims.row_len(), self.dims.state_len());
        let (mut o, mut states) = (Vec::with_capacity(self.out_len(n)), Vec::new());
        let mut r0 = 0;
        for (s, &len) in self.lens.iter().enumerate() {
            let (os, st) = chunked_host(
                self.dims,
                &rows[r0 * w..(r0 + len) * w],
                &init[s * sl..(s + 1) * sl],
                len,
            );
            o.extend(os);
            states.extend(st);
            r0 += len;
        }
        o.extend(states);
        Ok((CpuStorage::F32(o), Shape::from(self.out_len(n))))
    }

    /// Two kernels (`gdn_chunk.cu`, or `gdn_chunk_tc.cu`'s for `ChunkMath::Tf32`), every
    /// sequence in the grid's z: `gdn_chunk_prep` per (key head, chunk), all chunks at once (the Gram
    /// products once per key head; per value head T, X, Y, the decayed q and k, the masked
    /// q·k products and the cumulative decays into a scratch buffer), then `gdn_chunk_scan` per
    /// (value head, 32 value columns), chunk after chunk, carrying the state tile in shared
    /// memory.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, view};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let d = self.dims;
        if !cuda_supported(d) {
            candle_core::bail!(
                "gdn chunked kernel: dk <= 128, dv <= 256, both multiples of 4 expected, got {d:?}"
            );
        }
        let n = l1.shape().dims()[0];
        let dev = s1.device().clone();
        let rows = view::<f32>(s1, l1, "gdn rows")?;
        let init = view::<f32>(s2, l2, "gdn state")?;
        let tc = on_tensor_cores(self.math, d);
        let seqs = SeqsOnDevice::new(&dev, &self.lens)?;
        let scratch = prep_on_device(&dev, &rows, &seqs, d, tc)?;
        let out = alloc::<f32>(&dev, self.out_len(n))?;
        let (nseq, hk, hv, dk, dv) = seqs.kernel_args(d);
        let (ks, gcp) = (d.dk + 4, CHUNK + 4);
        // the tensor-core scan pads S and v' rows to 36 floats (no bank conflicts in its loads)
        let sp = if tc { 36 } else { 32 };
        let scan = LaunchConfig {
            grid_dim: (d.hv as u32, d.dv.div_ceil(32) as u32, seqs.b as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((d.dk * sp + CHUNK * (2 * ks + gcp + sp)) * 4) as u32,
        };
        launch!(
            dev,
            if tc {
                "gdn_chunk_scan_tc"
            } else {
                "gdn_chunk_scan"
            },
            DType::F32,
            scan,
            rows,
            init,
            scratch,
            out,
            seqs.table,
            nseq,
            hk,
            hv,
            dk,
            dv
        );
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(self.out_len(n)),
        ))
    }
}

/// A call's sequences on the device: [`seq_table`] uploaded once for both kernels, how many,
/// the most chunks one has and all chunks.
#[cfg(feature = "cuda")]
struct SeqsOnDevice {
    table: candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    b: usize,
    max_chunks: usize,
    chunks: usize,
}

#[cfg(feature = "cuda")]
impl SeqsOnDevice {
    fn new(dev: &candle_core::CudaDevice, lens: &[usize]) -> Result<Self> {
        let table = seq_table(lens);
        Ok(Self {
            b: lens.len(),
            max_chunks: lens.iter().map(|l| l.div_ceil(CHUNK)).max().unwrap_or(0),
            chunks: table[2 * lens.len() + 1] as usize,
            table: dev.clone_htod(&table)?,
        })
    }

    /// Both kernels' integer arguments: the sequences, then the head counts and sizes.
    fn kernel_args(&self, d: RecurrenceDims) -> (i32, i32, i32, i32, i32) {
        let i = |x: usize| x as i32;
        (i(self.b), i(d.hk), i(d.hv), i(d.dk), i(d.dv))
    }
}

/// The prep kernel alone into a fresh scratch buffer (the first half of [`gdn_chunked`] on a
/// GPU): per (value head, chunk) 64·(dv + 3·dk + 64) + 64 floats, the same for both kernels.
#[cfg(feature = "cuda")]
fn prep_on_device(
    dev: &candle_core::CudaDevice,
    rows: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, f32>,
    seqs: &SeqsOnDevice,
    d: RecurrenceDims,
    tc: bool,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    use crate::cuda::ptx::{alloc, launch};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    let per_chunk = CHUNK * (d.dv + 3 * d.dk + CHUNK) + CHUNK;
    let scratch = alloc::<f32>(dev, d.hv * seqs.chunks * per_chunk)?;
    let (nseq, hk, hv, dk, dv) = seqs.kernel_args(d);
    // shared memory as src/ops/gdn_chunk.cu lays it out; two blocks of each kernel fit an SM of
    // the H100/H200 (228 KiB) at head size 128
    let (ks, vs, gcp) = (d.dk + 4, d.dk.max(d.dv) + 4, CHUNK + 4);
    let prep = LaunchConfig {
        grid_dim: (d.hk as u32, seqs.max_chunks as u32, seqs.b as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: ((CHUNK * (ks + vs + 2 * gcp) + 3 * 256 + 4 * CHUNK) * 4) as u32,
    };
    launch!(
        dev,
        if tc {
            "gdn_chunk_prep_tc"
        } else {
            "gdn_chunk_prep"
        },
        DType::F32,
        prep,
        *rows,
        scratch,
        seqs.table,
        nseq,
        hk,
        hv,
        dk,
        dv
    );
    Ok(scratch)
}

/// The chunked rule's first kernel alone (GPU only): what `bench shape` times beside the whole
/// op. The result is the kernel's scratch (not meant to be read).
pub fn gdn_chunk_prep_only(rows: &Tensor, dims: RecurrenceDims, math: ChunkMath) -> Result<Tensor> {
    rows.contiguous()?
        .apply_op1_no_bwd(&PrepOnly { dims, math })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct PrepOnly {
    dims: RecurrenceDims,
    math: ChunkMath,
}

impl candle_core::CustomOp1 for PrepOnly {
    fn name(&self) -> &'static str {
        "gdn-chunk-prep"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("gdn chunk prep alone: a GPU kernel (the CPU runs the whole op)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        if !cuda_supported(self.dims) {
            candle_core::bail!("gdn chunk prep: unsupported head sizes {:?}", self.dims);
        }
        let dev = s1.device().clone();
        let n = l1.shape().dims()[0];
        let rows = crate::cuda::ptx::view::<f32>(s1, l1, "gdn rows")?;
        let seqs = SeqsOnDevice::new(&dev, &[n])?;
        let tc = on_tensor_cores(self.math, self.dims);
        let scratch = prep_on_device(&dev, &rows, &seqs, self.dims, tc)?;
        let len = scratch.len();
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(scratch, dev),
            Shape::from(len),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gdn_recurrence::recurrence_host;

    /// The chunked form equals the row-by-row recurrence up to f32 rounding, over chunk
    /// boundaries (150 rows: 64 + 64 + 22) and from a non-zero state, with 3 value heads per
    /// key head and head sizes that are not multiples of 32.
    #[test]
    fn chunked_equals_the_recurrence() {
        let d = RecurrenceDims {
            hk: 2,
            hv: 6,
            dk: 24,
            dv: 40,
        };
        let n = 150;
        let (r, init) = crate::cuda::kernel_check::gdn_rows(d, n, 3).unwrap();
        let r = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let init = init.to_vec1::<f32>().unwrap();
        let parents: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
        let (o_rec, s_rec) = recurrence_host(d, &r, &init, &parents, false);
        let (o, s) = chunked_host(d, &r, &init, n);
        let rel = |a: &[f32], b: &[f32]| {
            let t = |v: &[f32]| Tensor::new(v, &candle_core::Device::Cpu).unwrap();
            crate::ops::compare::rel_err(&t(a), &t(b)).unwrap()
        };
        assert!(rel(&o, &o_rec) < 1e-5, "o: {}", rel(&o, &o_rec));
        assert!(rel(&s, &s_rec) < 1e-5, "state: {}", rel(&s, &s_rec));
        // the op on the CPU is the twin
        let t = Tensor::from_vec(r, (n, d.row_len()), &candle_core::Device::Cpu).unwrap();
        let i = Tensor::from_vec(init, d.state_len(), &candle_core::Device::Cpu).unwrap();
        let (ot, st) = gdn_chunked(&t, &i, d, ChunkMath::F32).unwrap();
        assert_eq!(ot.flatten_all().unwrap().to_vec1::<f32>().unwrap(), o);
        assert_eq!(st.flatten_all().unwrap().to_vec1::<f32>().unwrap(), s);
    }

    /// Several sequences in one op: each one's output and state as the op on it alone (its
    /// rows from its own state), the table as its doc says.
    #[test]
    fn sequences_at_once_equal_each_alone() {
        assert_eq!(seq_table(&[150, 64]), vec![0, 150, 214, 0, 3, 4]);
        let d = RecurrenceDims {
            hk: 2,
            hv: 4,
            dk: 16,
            dv: 12,
        };
        let lens = [70usize, 5, 64];
        let dev = candle_core::Device::Cpu;
        let (rows, _) = crate::cuda::kernel_check::gdn_rows(d, lens.iter().sum(), 7).unwrap();
        let init = Tensor::rand(-1f32, 1f32, (3, d.state_len()), &dev).unwrap();
        let (o, st) = gdn_chunked_seqs(&rows, &init, &lens, d, ChunkMath::F32).unwrap();
        let mut r0 = 0;
        for (s, &len) in lens.iter().enumerate() {
            let (oa, sa) = gdn_chunked(
                &rows.narrow(0, r0, len).unwrap(),
                &init.get(s).unwrap(),
                d,
                ChunkMath::F32,
            )
            .unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(v(&o.narrow(0, r0, len).unwrap()), v(&oa), "sequence {s}");
            assert_eq!(v(&st.get(s).unwrap()), v(&sa), "sequence {s}");
            r0 += len;
        }
        let e = gdn_chunked_seqs(&rows, &init, &[70, 5], d, ChunkMath::F32).unwrap_err();
        assert!(e.to_string().contains("gdn chunked"), "{e}");
    }

    #[test]
    fn a_misshapen_input_is_named() {
        let d = RecurrenceDims {
            hk: 1,
            hv: 1,
            dk: 4,
            dv: 4,
        };
        let dev = candle_core::Device::Cpu;
        let t = Tensor::zeros((3, d.row_len() + 1), DType::F32, &dev).unwrap();
        let i = Tensor::zeros(d.state_len(), DType::F32, &dev).unwrap();
        let e = gdn_chunked(&t, &i, d, ChunkMath::Tf32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gdn chunked"), "{e}");
    }
}

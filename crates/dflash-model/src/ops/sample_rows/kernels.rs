//! The sampling ops on each device: on the CPU the host's rules row by row (the twins), on a
//! GPU the kernels' launches.

#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape};

use super::{Draw, Judge, RuleProbs};
use crate::ops::kernel_io::cpu_slice;

impl CustomOp1 for RuleProbs {
    fn name(&self) -> &'static str {
        "rule-probs"
    }

    /// The host's rule ([`dflash_core::sampling::dense_probs`]) row by row.
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let x = cpu_slice::<f32>(s, l, "rule_probs input")?;
        let params = dflash_core::sampling::SamplingParams {
            temperature: self.t,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: 0,
        };
        let out: Vec<f32> = x
            .chunks(v)
            .flat_map(|row| dflash_core::sampling::dense_probs(row, &params))
            .collect();
        Ok((CpuStorage::F32(out), Shape::from((n, v))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let (n, v) = l.shape().dims2()?;
        let dev = s.device().clone();
        let x = view::<f32>(s, l, "rule_probs input")?;
        let (vi, t, k, top_p) = (v as i32, self.t, self.top_k as i32, self.top_p);
        // `DFLASH_DISABLED_KERNELS=rule-search`: top-p alone by bisection too (32 reads of the row; the A/B's
        // reference)
        let bisect = dflash_core::runtime::off(dflash_core::runtime::Kernel::RuleSearch) as i32;
        let cut = self.top_k > 0 || self.top_p < 1.0;
        // the temperature's probabilities, then (with a cut) the kept ones renormalised
        let p = alloc::<f32>(&dev, n * v)?;
        launch!(
            dev,
            "temperature_probs",
            DType::F32,
            rows(n, 1024),
            x,
            p,
            vi,
            t
        );
        let out = match cut {
            false => p,
            true => {
                let out = alloc::<f32>(&dev, n * v)?;
                launch!(
                    dev,
                    "rule_probs",
                    DType::F32,
                    rows(n, 512),
                    x,
                    p,
                    out,
                    vi,
                    k,
                    top_p,
                    bisect
                );
                out
            }
        };
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, v)),
        ))
    }
}

impl CustomOp1 for Draw<'_> {
    fn name(&self) -> &'static str {
        "draw-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let w = cpu_slice::<f32>(s, l, "draw_rows weights")?;
        let out: Vec<u32> = w
            .chunks(v)
            .enumerate()
            .map(|(r, row)| {
                let total = row.iter().map(|&x| x as f64).sum();
                dflash_core::acceptance::pick_weighted(row, total, self.u.get(self.from + r))
            })
            .collect();
        Ok((CpuStorage::U32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let (n, v) = l.shape().dims2()?;
        let dev = s.device().clone();
        let w = view::<f32>(s, l, "draw_rows weights")?;
        let out = alloc::<u32>(&dev, n)?;
        let (vi, from) = (v as i32, self.from as i32);
        self.u.0.with_cuda_view("draw_rows uniforms", |u| {
            launch!(
                dev,
                "draw_rows",
                DType::F32,
                rows(n, 1024),
                w,
                u,
                out,
                vi,
                from
            );
            Ok(())
        })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(n),
        ))
    }
}

impl CustomOp3 for Judge<'_> {
    fn name(&self) -> &'static str {
        "judge-rows"
    }

    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sq: &CpuStorage,
        lq: &Layout,
        sd: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use dflash_core::acceptance::{judge, Verdict};
        let (n, v) = lp.shape().dims2()?;
        let p = cpu_slice::<f32>(sp, lp, "judge_rows p")?;
        let q = cpu_slice::<f32>(sq, lq, "judge_rows q")?;
        let d = cpu_slice::<u32>(sd, ld, "judge_rows drafts")?;
        let mut out = Vec::with_capacity(2 * n);
        for r in 0..n {
            let (ua, ub) = (self.u.get(self.accept + r), self.u.get(self.bonus + r));
            let row = |x: &[f32]| x[r * v..(r + 1) * v].to_vec();
            check_token(d[r], v)?;
            out.extend(match judge(&row(p), &row(q), d[r], ua, ub) {
                Verdict::Accept => [1, 0],
                Verdict::Reject { bonus } => [0, bonus],
            });
        }
        Ok((CpuStorage::U32(out), Shape::from((n, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sp: &candle_core::CudaStorage,
        lp: &Layout,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sd: &candle_core::CudaStorage,
        ld: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        let (n, v) = lp.shape().dims2()?;
        let dev = sp.device().clone();
        let p = view::<f32>(sp, lp, "judge_rows p")?;
        let q = view::<f32>(sq, lq, "judge_rows q")?;
        let d = view::<u32>(sd, ld, "judge_rows drafts")?;
        let out = alloc::<u32>(&dev, 2 * n)?;
        let (vi, ua, ub) = (v as i32, self.accept as i32, self.bonus as i32);
        self.u.0.with_cuda_view("judge_rows uniforms", |u| {
            launch!(
                dev,
                "judge_rows",
                DType::F32,
                rows(n, 1024),
                p,
                q,
                d,
                u,
                out,
                vi,
                ua,
                ub
            );
            Ok(())
        })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, 2)),
        ))
    }
}

fn check_token(t: u32, v: usize) -> Result<()> {
    if t as usize >= v {
        candle_core::bail!("judge_rows: draft {t} outside a vocabulary of {v}");
    }
    Ok(())
}

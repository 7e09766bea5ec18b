//! Sampling at T > 0 where the logits are: a round's probabilities, draws and speculative
//! verdicts computed on the device, so that a few indices per row leave it instead of every
//! row's full-vocabulary logits. The rules are the host's, in [`dflash_core::sampling`] and
//! [`dflash_core::acceptance`], and each CPU twin calls them:
//!
//! - [`temperature_probs`]: each row's softmax of `logits / T` ([`dflash_core::sampling::dense_probs`]
//!   without top-k or top-p, the normaliser summed in f64); [`rule_probs`]: the same with any
//!   top-k and top-p (each cut a boundary found by bisection or a 16-way search, no sort);
//! - [`draw_rows`]: each row's token for one uniform number `u`, walking the weights in token
//!   order (the first token whose cumulative weight exceeds `u · Σ w`; the last token of
//!   non-zero weight if rounding leaves `u · Σ w` past the end;
//!   [`dflash_core::acceptance::pick_weighted`]);
//! - [`judge_rows`]: each draft kept with probability `min(1, p(d) / q(d))` and, where it is
//!   not, the bonus drawn from the residual `max(0, p − q)` (from `p` when that is empty;
//!   [`dflash_core::acceptance::judge`]).
//!
//! The uniform numbers come from the generation's seeded host stream and reach the kernels in
//! one small table ([`Uniforms`]). The GPU sums a row's weights in another order than the host
//! (per thread, then across the block), so a draw whose `u` falls within rounding of a boundary
//! between two tokens can pick the other one: the same distribution, not always the host's
//! token for the same `u`.
//!
//! Example: logits rows [[0, ln 3], [0, 0]] at T = 1 → probabilities [[.25, .75], [.5, .5]];
//! `u` = [.2, .6] → tokens [0, 1]. Judging draft 1 (q = [.25, .75]) against p = [.5, .5]:
//! p(1)/q(1) = 2/3, kept when `u_accept` < 2/3; else the residual [.25, 0] gives token 0.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use crate::ops::kernel_io::{cpu_slice, KernelTable};

/// A round's uniform numbers in [0, 1), on the host for the CPU twins and uploaded once to a
/// GPU (as their f32 bits). Example: a chain of 15 drafts draws 46: 15 for the drafts, 15 to
/// accept, 15 for the bonus at a rejection, 1 for the bonus after the last row.
pub struct Uniforms(KernelTable);

impl Uniforms {
    pub fn new(u: &[f32], device: &Device) -> Result<Self> {
        Ok(Self(KernelTable::new(
            u.iter().map(|x| x.to_bits()).collect(),
            device,
        )?))
    }

    pub(crate) fn get(&self, i: usize) -> f32 {
        f32::from_bits(self.0.host[i])
    }

    pub(crate) fn len(&self) -> usize {
        self.0.host.len()
    }

    /// The numbers from `from` on, one per call (a CPU twin's `uniform`).
    pub(crate) fn stream_from(&self, from: usize) -> impl FnMut() -> f32 + '_ {
        let mut i = from;
        move || {
            i += 1;
            self.get(i - 1)
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn table(&self) -> &KernelTable {
        &self.0
    }
}

/// Each row's sampling distribution at temperature `t` > 0: `[n, v]` logits (any float dtype)
/// → `[n, v]` f32 probabilities.
pub fn temperature_probs(logits: &Tensor, t: f32) -> Result<Tensor> {
    if !(t > 0.0 && t.is_finite()) {
        candle_core::bail!("temperature_probs: a temperature > 0 expected, got {t}");
    }
    logits
        .to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&RuleProbs {
            t,
            top_k: 0,
            top_p: 1.0,
        })
}

/// Each row's sampling distribution under the rule (temperature `t`, `top_k`, 0: none,
/// `top_p`, 1: none), dense in token order with 0 where the rule drops a token:
/// [`dflash_core::sampling::dense_probs`] where the logits are. A plain temperature is
/// [`temperature_probs`]; otherwise on a GPU one block per row cuts the temperature
/// probabilities without sorting: each cut (the top k ranks, then the ranks whose mass before
/// them is below `top_p`) is a boundary logit found over the f32 total order (by bisection;
/// top-p alone by a 16-way search: 8 or 9 reads of the row), the tokens above it kept and, of the tokens at it, the
/// first by token id (the host's ranking breaks ties by the lower id); each cut renormalised
/// by its f64 sum. The sums run in another
/// order than the host's, so a probability can differ in its last bits and a top-p boundary
/// within rounding of `top_p` can move by one token: the same rule, up to rounding. The CPU
/// twin is the host's rule. Example: logits [0, 2, 1, −1], T = 1, top-k 3, top-p 0.7 →
/// [0, .731, .269, 0].
pub fn rule_probs(logits: &Tensor, t: f32, top_k: usize, top_p: f32) -> Result<Tensor> {
    if !(t > 0.0 && t.is_finite()) {
        candle_core::bail!("rule_probs: a temperature > 0 expected, got {t}");
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        candle_core::bail!("rule_probs: top-p in (0, 1] expected, got {top_p}");
    }
    let v = logits.dim(1)?;
    let top_k = if top_k >= v { 0 } else { top_k };
    if top_k == 0 && top_p >= 1.0 {
        return temperature_probs(logits, t);
    }
    logits
        .to_dtype(DType::F32)?
        .contiguous()?
        .apply_op1_no_bwd(&RuleProbs { t, top_k, top_p })
}

/// Row `r` of `w` (`[n, v]` f32 weights, not necessarily normalised) drawn with `u[from + r]`:
/// `[n]` u32 tokens, left on the device.
pub fn draw_rows(w: &Tensor, u: &Uniforms, from: usize) -> Result<Tensor> {
    let (n, v) = w.dims2()?;
    if v == 0 || from + n > u.len() {
        candle_core::bail!(
            "draw_rows: {n} rows of {v} weights from uniform {from} of {}",
            u.len()
        );
    }
    w.contiguous()?.apply_op1_no_bwd(&Draw { u, from })
}

/// The verdict on each draft `d[r]` (drawn from `q[r]`) against `p[r]` (`[n, v]` f32
/// probabilities each, `d` `[n]` u32), with `u[accept + r]` deciding the draft and
/// `u[bonus + r]` drawing the bonus: `[n, 2]` u32, (1, 0) for a kept draft and (0, bonus)
/// for a rejected one.
pub fn judge_rows(
    p: &Tensor,
    q: &Tensor,
    d: &Tensor,
    u: &Uniforms,
    accept: usize,
    bonus: usize,
) -> Result<Tensor> {
    let (n, v) = p.dims2()?;
    if q.dims2()? != (n, v) || d.dims1()? != n || accept.max(bonus) + n > u.len() {
        candle_core::bail!(
            "judge_rows: p {:?}, q {:?}, drafts {:?} and {} uniforms do not fit",
            p.dims(),
            q.dims(),
            d.dims(),
            u.len()
        );
    }
    p.contiguous()?.apply_op3_no_bwd(
        &q.contiguous()?,
        &d.contiguous()?,
        &Judge { u, accept, bonus },
    )
}

/// A sampling rule's probabilities: the temperature's, then top-k and top-p where asked (0 and
/// 1: none).
struct RuleProbs {
    t: f32,
    top_k: usize,
    top_p: f32,
}

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

struct Draw<'a> {
    u: &'a Uniforms,
    from: usize,
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

struct Judge<'a> {
    u: &'a Uniforms,
    accept: usize,
    bonus: usize,
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

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::acceptance::{judge, Verdict};

    fn on_cpu(rows: &[&[f32]]) -> Tensor {
        let v = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (rows.len(), v), &Device::Cpu).unwrap()
    }

    #[test]
    fn the_module_example() {
        let logits = on_cpu(&[&[0.0, 3f32.ln()], &[0.0, 0.0]]);
        let p = temperature_probs(&logits, 1.0).unwrap();
        let got = p.to_vec2::<f32>().unwrap();
        for (a, b) in got.iter().flatten().zip([0.25f32, 0.75, 0.5, 0.5]) {
            assert!((a - b).abs() < 1e-6, "{got:?}");
        }
        let u = Uniforms::new(&[0.2, 0.6, 0.5, 0.9], &Device::Cpu).unwrap();
        let t = draw_rows(&p, &u, 0).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(t, vec![0, 1]);
        let (q, pp) = (p.narrow(0, 0, 1).unwrap(), p.narrow(0, 1, 1).unwrap());
        let d = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        // u_accept .5 < 2/3: kept; .9: rejected, the residual [.25, 0] gives token 0
        let v = judge_rows(&pp, &q, &d, &u, 2, 0).unwrap();
        assert_eq!(v.to_vec2::<u32>().unwrap(), vec![vec![1, 0]]);
        let v = judge_rows(&pp, &q, &d, &u, 3, 0).unwrap();
        assert_eq!(v.to_vec2::<u32>().unwrap(), vec![vec![0, 0]]);
    }

    /// The ops equal the host's rules row by row, on rows with a dominant token, flat rows,
    /// p = q (an empty residual) and uniforms near 0 and 1.
    #[test]
    fn the_ops_are_the_host_rules() {
        let v = 257;
        let row = |s: u64| -> Vec<f32> {
            (0..v as u64)
                .map(|i| (((i + 3) * (s + 11) * 2654435761 % 1009) as f32 / 1009.0 - 0.5) * 6.0)
                .collect()
        };
        let mut rows: Vec<Vec<f32>> = (0..6).map(row).collect();
        rows[1][17] = 40.0; // one token takes almost all the mass
        rows[2] = vec![0.0; v];
        rows[3] = rows[0].clone(); // p = q against row 0
        let n = rows.len();
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let logits = on_cpu(&refs);
        let u: Vec<f32> = (0..3 * n)
            .map(|i| [0.0, 0.999_999, 0.37, 0.5, 0.81, 0.05][i % 6])
            .collect();
        let uni = Uniforms::new(&u, &Device::Cpu).unwrap();
        for t in [0.3f32, 1.0, 1.7] {
            let params = dflash_core::sampling::SamplingParams {
                temperature: t,
                ..Default::default()
            };
            let p = temperature_probs(&logits, t).unwrap();
            let host: Vec<Vec<f32>> = rows
                .iter()
                .map(|r| dflash_core::sampling::dense_probs(r, &params))
                .collect();
            assert_eq!(p.to_vec2::<f32>().unwrap(), host, "T {t}");
            let drawn = draw_rows(&p, &uni, 0).unwrap().to_vec1::<u32>().unwrap();
            for (r, q) in host.iter().enumerate() {
                let total = q.iter().map(|&x| x as f64).sum();
                let want = dflash_core::acceptance::pick_weighted(q, total, u[r]);
                assert_eq!(drawn[r], want, "T {t}, row {r}");
            }
            // judge rows 3.. (q) against rows 0.. (p): row 3 is row 0, so p = q there
            let (pp, q) = (p.narrow(0, 0, 3).unwrap(), p.narrow(0, 3, 3).unwrap());
            let d = Tensor::from_vec(drawn[3..].to_vec(), 3, &Device::Cpu).unwrap();
            let got = judge_rows(&pp, &q, &d, &uni, n, 2 * n).unwrap();
            for (r, g) in got.to_vec2::<u32>().unwrap().iter().enumerate() {
                let want = match judge(&host[r], &host[3 + r], drawn[3 + r], u[n + r], u[2 * n + r])
                {
                    Verdict::Accept => vec![1, 0],
                    Verdict::Reject { bonus } => vec![0, bonus],
                };
                assert_eq!(g, &want, "T {t}, row {r}");
            }
        }
    }

    /// `rule_probs_f32`'s algorithm, written again on the host (sums in token order instead of
    /// the block's): the temperature probabilities, then each cut as a boundary key (by
    /// bisection; top-p alone by the 16-way search of `key_search`) and the tokens at it kept
    /// by id, then renormalised.
    fn searched_rule(x: &[f32], t: f32, k: usize, top_p: f32) -> Vec<f32> {
        let key = |f: f32| {
            let i = f.to_bits() as i32;
            i ^ (((i >> 31) as u32) >> 1) as i32
        };
        let keys: Vec<i32> = x.iter().map(|&f| key(f)).collect();
        let v = x.len();
        let params = dflash_core::sampling::SamplingParams {
            temperature: t,
            ..Default::default()
        };
        let p = dflash_core::sampling::dense_probs(x, &params);
        // the top-k cut: `key_bisect`
        let bisect = |below: &dyn Fn(i32) -> bool| {
            let (mut lo, mut hi) = (i32::MIN as i64, i32::MAX as i64);
            while lo < hi {
                let mid = lo + ((hi - lo) >> 1);
                if below(mid as i32) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            lo as i32
        };
        // the top-p cut: `key_search`, 15 keys per pass, the sub-range that holds the answer kept
        let search = |below: &dyn Fn(i32) -> bool| {
            let (mut lo, mut hi) = (i32::MIN as i64, i32::MAX as i64);
            while lo < hi {
                let t: Vec<i64> = (1..16).map(|j| lo + (hi - lo) * j / 16).collect();
                match t.iter().position(|&m| below(m as i32)) {
                    Some(f) => {
                        hi = t[f];
                        if f > 0 {
                            lo = t[f - 1] + 1;
                        }
                    }
                    None => lo = t[14] + 1,
                }
            }
            lo as i32
        };
        let keep_prefix = |q: &[f32], b: i32, j: f64| -> Vec<f32> {
            let mut before = 0.0;
            (0..v)
                .map(|i| {
                    let keep = match keys[i].cmp(&b) {
                        std::cmp::Ordering::Greater => true,
                        std::cmp::Ordering::Equal => {
                            before += 1.0;
                            before - 1.0 < j
                        }
                        std::cmp::Ordering::Less => false,
                    };
                    if keep {
                        q[i]
                    } else {
                        0.0
                    }
                })
                .collect()
        };
        let sum = |q: &[f32]| q.iter().map(|&x| x as f64).sum::<f64>();
        let (mut q, mut mass) = (p.clone(), 1.0);
        if k > 0 && k < v {
            let count = |m: i32| keys.iter().filter(|&&c| c > m).count() as f64;
            let b = bisect(&|m| count(m) < k as f64);
            q = keep_prefix(&p, b, k as f64 - count(b));
            mass = sum(&q);
        }
        if top_p < 1.0 {
            let limit = top_p as f64 * mass;
            let above =
                |m: i32| -> f64 { (0..v).filter(|&i| keys[i] > m).map(|i| q[i] as f64).sum() };
            // top-p alone by the search, after a top-k cut by bisection (the kernel's choice)
            let b = match k > 0 && k < v {
                true => bisect(&|m| above(m) < limit),
                false => search(&|m| above(m) < limit),
            };
            let a = above(b);
            let pb = (0..v)
                .filter(|&i| keys[i] == b)
                .map(|i| q[i])
                .fold(0.0f32, f32::max);
            let j = if pb > 0.0 {
                ((limit - a) / pb as f64).ceil()
            } else {
                v as f64
            };
            q = keep_prefix(&q, b, j);
            mass = sum(&q);
        }
        q.iter().map(|&x| x / mass as f32).collect()
    }

    /// Any top-k and top-p without a sort, as the device computes it ([`searched_rule`]): the
    /// host's `dense_probs` — the same tokens kept, each probability within 1e-5 — on rows
    /// with ties at the k-th logit and at the top-p boundary (the lower token ids kept), one
    /// dominant token, a flat row, −∞ logits and the doc's example; `rule_probs` on the CPU is
    /// the host's rule itself, and refuses a bad top-p by name.
    #[test]
    fn rule_probs_are_the_host_rule() {
        let v = 300;
        let mut rows: Vec<Vec<f32>> = (0..5u64)
            .map(|s| {
                (0..v as u64)
                    .map(|i| (((i + 5) * (s + 7) * 2654435761 % 997) as f32 / 997.0 - 0.5) * 8.0)
                    .collect()
            })
            .collect();
        rows[1][42] = 30.0;
        rows[2] = vec![1.0; v]; // all tied: every cut keeps the lowest ids
        rows[3][7] = 9.0;
        rows[3][8] = 9.0; // a tie at the top
        rows[4][10..20].fill(2.5); // ten tokens tied in the middle of the ranking
        rows.push({
            let mut r = vec![-50.0; v];
            r[..4].copy_from_slice(&[0.0, 2.0, 1.0, -1.0]);
            r
        });
        rows.push({
            let mut r = vec![f32::NEG_INFINITY; v];
            r[3] = 1.0;
            r[9] = 0.5;
            r
        });
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let logits = on_cpu(&refs);
        // top-p off the flat row's grid of j / k: a cut exactly there is within rounding of
        // top-p, where the host's f32 running sum and the device's f64 sums may keep one token
        // more or less (the documented boundary move)
        for (t, k, top_p) in [
            (1.0f32, 3, 0.7f32),
            (0.7, 20, 0.905),
            (1.3, 64, 1.0),
            (1.0, 1, 0.5),
            (0.5, 50, 0.305),
            (1.0, 0, 0.9013),
            (0.8, 0, 0.5017),
            (1.2, 0, 0.999),
            (1.0, 200, 1.0),
            (0.9, 299, 0.95),
            (1.0, 150, 0.6033),
        ] {
            let params = dflash_core::sampling::SamplingParams {
                temperature: t,
                top_k: k,
                top_p,
                ..Default::default()
            };
            let on_cpu = rule_probs(&logits, t, k, top_p)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for (r, row) in rows.iter().enumerate() {
                let want = dflash_core::sampling::dense_probs(row, &params);
                assert_eq!(on_cpu[r], want, "T {t} k {k} p {top_p} row {r}");
                let got = searched_rule(row, t, k, top_p);
                for (j, (&a, &b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a > 0.0,
                        b > 0.0,
                        "T {t} k {k} p {top_p} row {r} token {j}: {a} vs {b}"
                    );
                    // the host renormalises a nucleus by an f32 sum in rank order (≈ n ulps
                    // over n tokens), the device by an f64 sum
                    assert!(
                        (a - b).abs() <= 1e-5 * b,
                        "T {t} k {k} p {top_p} row {r} token {j}: {a} vs {b}"
                    );
                }
            }
        }
        // the doc's example: logits [0, 2, 1, −1] (the rest far below), T 1, top-k 3, top-p .7
        let ex = searched_rule(&rows[5], 1.0, 3, 0.7);
        assert!(
            (ex[1] - 0.731).abs() < 1e-3 && (ex[2] - 0.269).abs() < 1e-3,
            "{:?}",
            &ex[..4]
        );
        assert_eq!((ex[0], ex[3]), (0.0, 0.0));
        let e = rule_probs(&logits, 1.0, 0, 0.0).unwrap_err().to_string();
        assert!(e.contains("top-p in (0, 1]"), "{e}");
    }

    #[test]
    fn bad_inputs_are_refused() {
        let p = on_cpu(&[&[0.5, 0.5]]);
        let u = Uniforms::new(&[0.5], &Device::Cpu).unwrap();
        assert!(temperature_probs(&p, 0.0).is_err());
        assert!(draw_rows(&p, &u, 1).is_err());
        let d = Tensor::new(&[2u32], &Device::Cpu).unwrap();
        let e = judge_rows(&p, &p, &d, &u, 0, 1).unwrap_err().to_string();
        assert!(e.contains("uniforms do not fit"), "{e}");
        let u2 = Uniforms::new(&[0.5, 0.5], &Device::Cpu).unwrap();
        let e = judge_rows(&p, &p, &d, &u2, 0, 1).unwrap_err().to_string();
        assert!(e.contains("outside a vocabulary"), "{e}");
    }
}

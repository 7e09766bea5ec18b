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

use candle_core::{DType, Device, Result, Tensor};

use crate::ops::kernel_io::KernelTable;

mod kernels;
#[cfg(test)]
mod tests;

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

struct Draw<'a> {
    u: &'a Uniforms,
    from: usize,
}

struct Judge<'a> {
    u: &'a Uniforms,
    accept: usize,
    bonus: usize,
}

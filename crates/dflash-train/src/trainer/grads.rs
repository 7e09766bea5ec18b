//! A step's gradients summed: over this rank's rows (the halving tree of
//! [`crate::collective`]) and over the ranks, in one bucket per drafter layer.
//!
//! With several ranks the last row of a rank's slice runs its backward with the buckets
//! started as its layers finish: the drafter's written backward ends layer 4 of 5 first, so
//! layer 4's bucket (its weights' gradients, flat, at the masters' precision) starts its sum
//! over the ranks while layers 3..0 still run theirs; then 3, 2, 1, 0, and last the rest
//! (`fc`, `hidden_norm`, the final norm, a DFlash2 selector). Every rank starts the same
//! buckets in the same order. A bucket's sum is element-wise, so the buckets give the numbers
//! one flat bucket would: at f32 on the CPU ranks, N ranks still equal one rank bit for bit.
//!
//! The rows before the last are summed as the halving tree's left subtrees along the path to
//! the last row, and each layer's gradients of the last row added into them from the deepest
//! up: for rows 0..4, `(g0+g1) + (g2+g3)` becomes `(g0+g1) + (g2 + g3[layer])` per layer, the
//! same additions in the same order as the tree over whole rows.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor, Var};

use crate::collective::{Collective, PendingSum};

/// `a + b`, in f32 when either is bf16 (a sum of the compute copies' gradients over a step's
/// rows is taken at the masters' precision; f32 and f64 sums stay as they are).
pub(super) fn add_wide(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let wide = |t: &Tensor| {
        if t.dtype() == DType::BF16 {
            t.to_dtype(DType::F32)
        } else {
            Ok(t.clone())
        }
    };
    wide(a)? + wide(b)?
}

/// One parameter's gradients added (a missing one counts as 0).
fn add_one(x: Option<Tensor>, y: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match (x, y) {
        (Some(x), Some(y)) => Some(add_wide(&x, &y)?),
        (x, None) => x,
        (None, y) => y,
    })
}

/// The parameters' gradients summed element-wise (a missing one is `None`; bf16 ones in f32).
pub(super) fn add_grads(
    a: Vec<Option<Tensor>>,
    b: Vec<Option<Tensor>>,
) -> Result<Vec<Option<Tensor>>> {
    a.into_iter().zip(b).map(|(x, y)| add_one(x, y)).collect()
}

/// The halving tree's left subtrees along the path to the last row of `lo..hi`, from the top:
/// for 0..5 (`((0+1)+2) + (3+4)`), the sums of 0..3 and of 3..4, the last row being 4.
/// `subtree(lo, hi)` sums a range; the last row's index is returned beside them.
pub(super) fn path_to_last<T>(
    lo: usize,
    hi: usize,
    subtree: &mut dyn FnMut(usize, usize) -> Result<T>,
) -> Result<(Vec<T>, usize)> {
    if lo >= hi {
        bail!("a rank with no rows in its slice");
    }
    let (mut lo, mut left) = (lo, Vec::new());
    while hi - lo > 1 {
        let mid = lo + (hi - lo).div_ceil(2);
        left.push(subtree(lo, mid)?);
        lo = mid;
    }
    Ok((left, lo))
}

/// Parameter `i`'s gradient of the whole slice: the last row's `leaf` added into the left
/// subtrees from the deepest up ([`path_to_last`]).
pub(super) fn fold_path(
    left: &[Vec<Option<Tensor>>],
    i: usize,
    leaf: Option<Tensor>,
) -> Result<Option<Tensor>> {
    left.iter()
        .rev()
        .try_fold(leaf, |v, sub| add_one(sub[i].clone(), v))
}

/// The step's buckets: one per drafter layer (the parameters named `layers.{l}.…`), then one
/// of the rest, started in the order the backward finishes them (layers from the last down,
/// then the rest) and read back in that order.
pub(super) struct GradBuckets<'a> {
    params: &'a [(String, Var)],
    /// per bucket, its parameters' indices; the rest last
    members: Vec<Vec<usize>>,
    /// the buckets started so far, in order
    started: Vec<(usize, PendingSum)>,
    /// the next bucket to start (counting down from the last layer; the rest is `layers`)
    next: Option<usize>,
    layers: usize,
}

impl<'a> GradBuckets<'a> {
    /// The buckets of `params` for a drafter of `layers` layers.
    pub fn new(params: &'a [(String, Var)], layers: usize) -> Self {
        let mut members = vec![Vec::new(); layers + 1];
        for (i, (name, _)) in params.iter().enumerate() {
            members[layer_of(name).filter(|&l| l < layers).unwrap_or(layers)].push(i);
        }
        Self {
            params,
            members,
            started: Vec::new(),
            next: layers.checked_sub(1),
            layers,
        }
    }

    /// Layer `l`'s gradients are done: start its bucket (`grad(i)` gives parameter `i`'s).
    /// Layers come from the last down.
    pub fn layer_done(
        &mut self,
        l: usize,
        comm: &dyn Collective,
        grad: &mut dyn FnMut(usize) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        if self.next != Some(l) {
            bail!(
                "gradient buckets: layer {l} finished out of order (expected {:?})",
                self.next
            );
        }
        self.next = l.checked_sub(1);
        self.start(l, comm, grad)
    }

    /// The backward is over: start what has not started (every layer's bucket when the
    /// backward reported none: candle's autograd), then the rest, and read every sum back,
    /// one gradient per parameter.
    pub fn finish(
        mut self,
        comm: &dyn Collective,
        grad: &mut dyn FnMut(usize) -> Result<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        while let Some(l) = self.next {
            self.next = l.checked_sub(1);
            self.start(l, comm, grad)?;
        }
        self.start(self.layers, comm, grad)?;
        let mut out: Vec<Option<Tensor>> = vec![None; self.params.len()];
        for (b, pending) in std::mem::take(&mut self.started) {
            let sum = pending.wait()?;
            let mut off = 0;
            for &i in &self.members[b] {
                let p = self.params[i].1.as_tensor();
                let n = p.elem_count();
                out[i] = Some(sum.narrow(0, off, n)?.reshape(p.shape())?);
                off += n;
            }
        }
        Ok(out)
    }

    /// Bucket `b`'s gradients, flat at the masters' precision (a missing one as zeros), handed
    /// to the ranks' sum; an empty bucket (a layer no parameter of which is trained) is skipped
    /// alike on every rank.
    fn start(
        &mut self,
        b: usize,
        comm: &dyn Collective,
        grad: &mut dyn FnMut(usize) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        if self.members[b].is_empty() {
            return Ok(());
        }
        let flat = self.members[b]
            .iter()
            .map(|&i| {
                let p = self.params[i].1.as_tensor();
                Ok(match grad(i)? {
                    Some(g) => g.to_dtype(p.dtype())?.flatten_all()?,
                    None => Tensor::zeros(p.elem_count(), p.dtype(), p.device())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pending = comm.start_all_reduce(&Tensor::cat(&flat, 0)?)?;
        self.started.push((b, pending));
        Ok(())
    }
}

/// The drafter layer a parameter belongs to: `layers.3.mlp.up_proj.weight` → 3; `fc.weight`
/// → none.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::halving_sum;

    /// The path's subtrees with the last row folded in are the halving tree over the rows.
    #[test]
    fn the_path_to_the_last_row_folds_into_the_halving_tree() {
        for (lo, hi) in [(0, 1), (0, 2), (0, 5), (3, 8), (0, 8), (2, 9)] {
            let tree = |lo, hi| {
                halving_sum(lo, hi, &mut |i| Ok(format!("{i}")), &|a, b| {
                    Ok(format!("({a}+{b})"))
                })
                .unwrap()
            };
            let (left, last) = path_to_last(lo, hi, &mut |a, b| Ok(tree(a, b))).unwrap();
            assert_eq!(last, hi - 1);
            let folded = left
                .iter()
                .rev()
                .fold(format!("{last}"), |v, s| format!("({s}+{v})"));
            assert_eq!(folded, tree(lo, hi), "{lo}..{hi}");
        }
        assert!(path_to_last(3, 3, &mut |_, _| Ok(())).is_err());
    }

    #[test]
    fn parameters_go_to_their_layers_bucket_or_the_rest() {
        assert_eq!(layer_of("layers.3.mlp.up_proj.weight"), Some(3));
        assert_eq!(layer_of("layers.12.self_attn.q_norm.weight"), Some(12));
        assert_eq!(layer_of("fc.weight"), None);
        assert_eq!(layer_of("hidden_norm.weight"), None);
        assert_eq!(layer_of("layersx.1.w"), None);
    }

    /// Buckets start last layer first and refuse another order; `finish` starts the rest.
    #[test]
    fn buckets_start_in_the_backwards_order() {
        let dev = candle_core::Device::Cpu;
        let var = |v: f32| Var::from_tensor(&Tensor::new(&[v, v], &dev).unwrap()).unwrap();
        let params = vec![
            ("fc.weight".to_string(), var(0.0)),
            ("layers.0.w".to_string(), var(0.0)),
            ("layers.1.w".to_string(), var(0.0)),
        ];
        let comm = crate::collective::Single;
        let mut grad = |i: usize| Ok(Some(Tensor::new(&[i as f32, 10.0 * i as f32], &dev)?));
        let mut b = GradBuckets::new(&params, 2);
        let e = b.layer_done(0, &comm, &mut grad).unwrap_err().to_string();
        assert!(e.contains("out of order"), "{e}");
        b.layer_done(1, &comm, &mut grad).unwrap();
        let order: Vec<usize> = b.started.iter().map(|(x, _)| *x).collect();
        assert_eq!(order, vec![1]);
        let g = b.finish(&comm, &mut grad).unwrap();
        let got: Vec<Vec<f32>> = g
            .iter()
            .map(|t| t.as_ref().unwrap().to_vec1().unwrap())
            .collect();
        assert_eq!(got, vec![vec![0.0, 0.0], vec![1.0, 10.0], vec![2.0, 20.0]]);
    }
}

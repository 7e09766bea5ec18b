//! DDTree at T > 0 where the logits are: the sampled tree's draws without replacement and its
//! walk by recursive rejection sampling ([`dflash_core::sampled_tree`]), so that a round reads
//! back a few draws per depth and the walk's path and bonus instead of the drafter's and the
//! target's full-vocabulary rows. The rules are the host's and each CPU twin calls them:
//!
//! - [`draw_distinct_rows`]: each row's first `k` draws without replacement
//!   ([`dflash_core::sampled_tree::draws_without_replacement`]), draw j of row r with
//!   `u[from + r·k + j]`; once a row's tokens of non-zero weight are all drawn, token 0 (a
//!   shape never reads those: it ranks held tokens only);
//! - [`walk_tree_rows`]: the walk ([`dflash_core::sampled_tree::walk_judged`]) over the target's
//!   distribution at every tree row and the draft distribution of every depth, with
//!   `u[from ..]` (one number per judged child, one for the bonus: at most one per tree row).
//!
//! On a GPU one block per row draws (each draw a block-wide pick over a working copy of the row
//! with the drawn tokens zeroed), and one block walks the whole tree (each rejection rewrites
//! the residual `p` and the reduced `q` in two working rows). The GPU sums in another order
//! than the host (per thread, then across the block), so a draw or a renormalised value within
//! rounding of a boundary can differ: the same distribution, not always the host's token for
//! the same `u`.
//!
//! Example: the tree anchor → {a, b} (both at depth 1), p at the root [.5, .3, .2], q of depth 1
//! [.2, .6, .2], a = 1, b = 0, uniforms [.7, .1]: child a kept with probability .3 / .6 = .5,
//! rejected by .7; the residual p is [1, 0, 0], q without a is [.5, 0, .5], so b (token 0) is
//! kept (p ≥ q there): path [b's row], and the bonus is then drawn at b's row (a leaf).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Device, Layout, Result, Shape, Tensor};
use dflash_core::sampled_tree::{draws_without_replacement, walk_judged};
use dflash_core::sampling::{dense_probs, SamplingParams};
use dflash_core::tree::DraftTree;

use crate::ops::kernel_io::{cpu_slice, KernelTable};
use crate::ops::sample_rows::{rule_probs, Uniforms};

/// Row r's first `k` draws without replacement from `q` (`[n, v]` f32 weights, not
/// necessarily normalised), draw j with `u[from + r·k + j]`: `[n, k]` u32, left on the device.
/// Example: q [[.5, 0, .5]], k 3, uniforms [.7, .2, .9] → [[2, 0, 0]] (token 2, then token 0,
/// then nothing is left: 0).
pub fn draw_distinct_rows(q: &Tensor, u: &Uniforms, from: usize, k: usize) -> Result<Tensor> {
    let (n, v) = q.dims2()?;
    if v == 0 || k == 0 || from + n * k > u.len() {
        candle_core::bail!(
            "draw_distinct_rows: {k} draws from each of {n} rows of {v} weights from uniform {from} of {}",
            u.len()
        );
    }
    q.contiguous()?
        .apply_op1_no_bwd(&DrawDistinct { u, from, k })
}

/// The draws a sampled tree's shape needs: `counts[r]` from row r of `q` (`[n, v]` f32, n ≥ the
/// rows counted), the j-th with `u[from + r·k + j]` where k is the largest count — the first
/// `counts[r]` of [`draw_distinct_rows`]' k, read back. On the CPU only the counted draws are
/// made (the same tokens). Example: counts [2, 1] → 2 draws from row 0 with `u[from]`,
/// `u[from + 1]` and 1 from row 1 with `u[from + 2]`.
pub fn draw_distinct(
    q: &Tensor,
    u: &Uniforms,
    from: usize,
    counts: &[usize],
) -> Result<Vec<Vec<u32>>> {
    let k = counts.iter().copied().max().unwrap_or(0);
    let rows = counts.len();
    if k == 0 {
        return Ok(vec![Vec::new(); rows]);
    }
    let q = q.narrow(0, 0, rows)?;
    if q.device().is_cpu() {
        if from + rows * k > u.len() {
            candle_core::bail!("draw_distinct: uniforms {from}.. of {}", u.len());
        }
        let qs = q.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        return Ok(qs
            .iter()
            .zip(counts)
            .enumerate()
            .map(|(r, (row, &c))| draws_without_replacement(row, c, u.stream_from(from + r * k)))
            .collect());
    }
    let mut all = draw_distinct_rows(&q, u, from, k)?.to_vec2::<u32>()?;
    for (row, &c) in all.iter_mut().zip(counts) {
        row.truncate(c);
    }
    Ok(all)
}

/// A tree as the walk kernel reads it, on the host and the device: `[n, first[0..=n], kids[0..n−1],
/// tokens[0..n], depths[0..n]]` — node i's children are `kids[first[i]..first[i+1]]`, in index
/// order (the order [`DraftTree::children`] gives and the draws were made in). Example: the
/// chain x → a → b (tokens 7, 8, 9) is `[3, 0, 1, 2, 2, 1, 2, 7, 8, 9, 0, 1, 2]`.
pub struct TreeTable(KernelTable);

impl TreeTable {
    pub fn new(tree: &DraftTree, device: &Device) -> Result<Self> {
        let n = tree.len();
        if n == 0 {
            candle_core::bail!("a tree table of no nodes");
        }
        let mut first = Vec::with_capacity(n + 1);
        let mut kids = Vec::with_capacity(n - 1);
        for i in 0..n {
            first.push(kids.len() as u32);
            kids.extend(tree.children(i).map(|c| c as u32));
        }
        first.push(kids.len() as u32);
        let mut host = vec![n as u32];
        host.extend(first);
        host.extend(kids);
        host.extend(&tree.tokens);
        host.extend(tree.depths.iter().map(|&d| d as u32));
        Ok(Self(KernelTable::new(host, device)?))
    }

    fn nodes(&self) -> usize {
        self.0.host[0] as usize
    }

    /// The tree back from the table (the CPU twin reads what the kernel reads).
    fn tree(&self) -> Result<DraftTree> {
        let h = &self.0.host;
        let n = self.nodes();
        if h.len() != 1 + (n + 1) + (n - 1) + 2 * n {
            candle_core::bail!("a tree table of {} values for {n} nodes", h.len());
        }
        let (first, rest) = h[1..].split_at(n + 1);
        let (kids, rest) = rest.split_at(n - 1);
        let (tokens, depths) = rest.split_at(n);
        let mut parents = vec![None; n];
        for i in 0..n {
            for &c in &kids[first[i] as usize..first[i + 1] as usize] {
                parents[c as usize] = Some(i);
            }
        }
        Ok(DraftTree {
            tokens: tokens.to_vec(),
            parents,
            depths: depths.iter().map(|&d| d as usize).collect(),
        })
    }

    /// The deepest depth a node with children has (its children were drawn from `q` of that
    /// row), or `None` for a root alone.
    fn deepest_parent(&self) -> Option<usize> {
        let h = &self.0.host;
        let n = self.nodes();
        (0..n)
            .filter(|&i| h[1 + i] != h[2 + i])
            .map(|i| h[1 + (n + 1) + (n - 1) + n + i] as usize)
            .max()
    }
}

/// The walk down `tree` ([`dflash_core::sampled_tree::walk_judged`]): `p` `[n, v]` f32, the
/// target's distribution at each of the tree's n rows; `q` `[depths, v]` f32, row d the draft
/// distribution of depth d + 1; uniforms from `u[from]` (at most n). Returns `[n + 2]` u32
/// where they are: the path's length, the bonus, then the path's tree rows (the rest unused);
/// [`walk_outcome`] reads it.
pub fn walk_tree_rows(
    p: &Tensor,
    q: &Tensor,
    tree: &TreeTable,
    u: &Uniforms,
    from: usize,
) -> Result<Tensor> {
    let ((n, v), (dq, vq)) = (p.dims2()?, q.dims2()?);
    let n_tree = tree.nodes();
    if n != n_tree || v != vq || from + n > u.len() {
        candle_core::bail!(
            "walk_tree_rows: p {:?}, q {:?}, a tree of {n_tree} nodes and uniforms {from}.. of {} do not fit",
            p.dims(),
            q.dims(),
            u.len()
        );
    }
    if let Some(d) = tree.deepest_parent() {
        if d >= dq {
            candle_core::bail!("walk_tree_rows: a node at depth {d} has children, q has {dq} rows");
        }
    }
    p.contiguous()?
        .apply_op2_no_bwd(&q.contiguous()?, &WalkTree { tree, u, from })
}

/// The accepted path (tree rows, root excluded) and the bonus from [`walk_tree_rows`]'s output.
pub fn walk_outcome(out: &[u32]) -> (Vec<usize>, u32) {
    let len = out[0] as usize;
    (
        out[2..2 + len].iter().map(|&r| r as usize).collect(),
        out[1],
    )
}

/// A round's walk from the verify's logits (`[n, v]`, any float dtype) under the request's
/// rule, where they are: on a GPU every row's distribution ([`rule_probs`]), then
/// [`walk_tree_rows`], one read; on the CPU the twin's walk, each visited row's distribution
/// computed when the walk reaches it (a tree's other rows are never normalised).
pub fn walk_sampled_tree(
    logits: &Tensor,
    params: &SamplingParams,
    q: &Tensor,
    tree: &DraftTree,
    u: &Uniforms,
    from: usize,
) -> Result<(Vec<usize>, u32)> {
    if logits.device().is_cpu() {
        if from + tree.len() > u.len() {
            candle_core::bail!("walk_sampled_tree: uniforms {from}.. of {}", u.len());
        }
        let qs = q.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        return walk_judged(
            tree,
            |d| &qs[d],
            |r| {
                let row = logits.get(r)?.to_dtype(candle_core::DType::F32)?;
                Ok::<_, candle_core::Error>(dense_probs(&row.to_vec1::<f32>()?, params))
            },
            u.stream_from(from),
        );
    }
    let p = rule_probs(logits, params.temperature, params.top_k, params.top_p)?;
    let table = TreeTable::new(tree, logits.device())?;
    let out = walk_tree_rows(&p, q, &table, u, from)?.to_vec1::<u32>()?;
    Ok(walk_outcome(&out))
}

struct DrawDistinct<'a> {
    u: &'a Uniforms,
    from: usize,
    k: usize,
}

impl CustomOp1 for DrawDistinct<'_> {
    fn name(&self) -> &'static str {
        "draw-distinct-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        let q = cpu_slice::<f32>(s, l, "draw_distinct_rows weights")?;
        let mut out = Vec::with_capacity(n * self.k);
        for (r, row) in q.chunks(v).enumerate() {
            let mut drawn =
                draws_without_replacement(row, self.k, self.u.stream_from(self.from + r * self.k));
            drawn.resize(self.k, 0);
            out.extend(drawn);
        }
        Ok((CpuStorage::U32(out), Shape::from((n, self.k))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        use candle_core::DType;
        let (n, v) = l.shape().dims2()?;
        let dev = s.device().clone();
        let q = view::<f32>(s, l, "draw_distinct_rows weights")?;
        let work = alloc::<f32>(&dev, n * v)?;
        let out = alloc::<u32>(&dev, n * self.k)?;
        let (vi, ki, from) = (v as i32, self.k as i32, self.from as i32);
        self.u
            .table()
            .with_cuda_view("draw_distinct_rows uniforms", |u| {
                launch!(
                    dev,
                    "draw_distinct_rows",
                    DType::F32,
                    rows(n, 1024),
                    q,
                    work,
                    u,
                    out,
                    vi,
                    ki,
                    from
                );
                Ok(())
            })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((n, self.k)),
        ))
    }
}

struct WalkTree<'a> {
    tree: &'a TreeTable,
    u: &'a Uniforms,
    from: usize,
}

impl CustomOp2 for WalkTree<'_> {
    fn name(&self) -> &'static str {
        "walk-tree-rows"
    }

    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sq: &CpuStorage,
        lq: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = lp.shape().dims2()?;
        let p = cpu_slice::<f32>(sp, lp, "walk_tree_rows p")?;
        let q = cpu_slice::<f32>(sq, lq, "walk_tree_rows q")?;
        let tree = self.tree.tree()?;
        let (path, bonus) = walk_judged(
            &tree,
            |d| &q[d * v..(d + 1) * v],
            |r| Ok::<_, candle_core::Error>(p[r * v..(r + 1) * v].to_vec()),
            self.u.stream_from(self.from),
        )?;
        let mut out = vec![0u32; n + 2];
        out[0] = path.len() as u32;
        out[1] = bonus;
        for (j, &r) in path.iter().enumerate() {
            out[2 + j] = r as u32;
        }
        Ok((CpuStorage::U32(out), Shape::from(n + 2)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sp: &candle_core::CudaStorage,
        lp: &Layout,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::ptx::{alloc, launch, rows, view};
        use candle_core::backend::BackendStorage;
        use candle_core::DType;
        let (n, v) = lp.shape().dims2()?;
        let dev = sp.device().clone();
        let p = view::<f32>(sp, lp, "walk_tree_rows p")?;
        let q = view::<f32>(sq, lq, "walk_tree_rows q")?;
        let (pw, qw) = (alloc::<f32>(&dev, v)?, alloc::<f32>(&dev, v)?);
        let out = dev.alloc_zeros::<u32>(n + 2)?;
        let (vi, from) = (v as i32, self.from as i32);
        self.tree.0.with_cuda_view("walk_tree_rows tree", |tab| {
            self.u
                .table()
                .with_cuda_view("walk_tree_rows uniforms", |u| {
                    launch!(
                        dev,
                        "walk_tree",
                        DType::F32,
                        rows(1, 1024),
                        p,
                        q,
                        tab,
                        u,
                        pw,
                        qw,
                        out,
                        vi,
                        from
                    );
                    Ok(())
                })
        })?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(n + 2),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_core::sampled_tree::{place_draws, sampled_shape};

    fn cpu(v: Vec<f32>, n: usize) -> Tensor {
        let w = v.len() / n;
        Tensor::from_vec(v, (n, w), &Device::Cpu).unwrap()
    }

    /// The module's and the functions' examples, on the CPU twins.
    #[test]
    fn the_examples() {
        let u = Uniforms::new(&[0.7, 0.2, 0.9], &Device::Cpu).unwrap();
        let d = draw_distinct_rows(&cpu(vec![0.5, 0.0, 0.5], 1), &u, 0, 3).unwrap();
        assert_eq!(d.to_vec2::<u32>().unwrap(), vec![vec![2, 0, 0]]);

        let chain = DraftTree::chain(7, &[8, 9]);
        let t = TreeTable::new(&chain, &Device::Cpu).unwrap();
        assert_eq!(t.0.host, vec![3, 0, 1, 2, 2, 1, 2, 7, 8, 9, 0, 1, 2]);
        assert_eq!(t.tree().unwrap(), chain);

        // anchor → {a = 1, b = 0} at depth 1
        let tree = DraftTree {
            tokens: vec![2, 1, 0],
            parents: vec![None, Some(0), Some(0)],
            depths: vec![0, 1, 1],
        };
        let p = cpu(vec![0.5, 0.3, 0.2, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0], 3);
        let q = cpu(vec![0.2, 0.6, 0.2], 1);
        let u = Uniforms::new(&[0.7, 0.1, 0.5], &Device::Cpu).unwrap();
        let table = TreeTable::new(&tree, &Device::Cpu).unwrap();
        let out = walk_tree_rows(&p, &q, &table, &u, 0).unwrap();
        // b (row 2) kept; its row is a leaf: the bonus drawn there (token 2, all its mass)
        assert_eq!(walk_outcome(&out.to_vec1().unwrap()), (vec![2], 2));
    }

    /// The walk over the rows' probabilities (the op's twin) equals the walk that normalises
    /// each visited row's logits when it gets there (the CPU's path), for sampled trees of
    /// random drafter-like rows under three rules, and its draws are distinct tokens of
    /// non-zero mass.
    #[test]
    fn the_walk_over_probabilities_is_the_walk_over_logits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (v, depths, budget) = (40, 5, 8);
        for rule in [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.8)] {
            let params = SamplingParams {
                temperature: rule.0,
                top_k: rule.1,
                top_p: rule.2,
                seed: 0,
            };
            for case in 0..20 {
                let logits = |n: usize, rng: &mut rand_chacha::ChaCha8Rng| {
                    let x: Vec<f32> = (0..n * v)
                        .map(|i| rng.random::<f32>() * 3.0 + if i % v == i / v { 3.0 } else { 0.0 })
                        .collect();
                    cpu(x, n)
                };
                let draft = logits(depths, &mut rng);
                let q = rule_probs(&draft, params.temperature, params.top_k, params.top_p).unwrap();
                let uni: Vec<f32> = (0..depths * budget + budget + 1)
                    .map(|_| rng.random())
                    .collect();
                let u = Uniforms::new(&uni, &Device::Cpu).unwrap();
                let tops = crate::ops::top_k::top_k_rows(&q, budget).unwrap();
                let (mut tree, needed) = sampled_shape(3, &tops, budget);
                let draws = draw_distinct_rows(&q, &u, 0, budget)
                    .unwrap()
                    .to_vec2::<u32>()
                    .unwrap();
                let qs = q.to_vec2::<f32>().unwrap();
                for (d, row) in draws.iter().enumerate() {
                    let kept = &row[..needed[d]];
                    assert!(kept.iter().all(|&t| qs[d][t as usize] > 0.0), "case {case}");
                    let mut dedup = kept.to_vec();
                    dedup.sort();
                    dedup.dedup();
                    assert_eq!(dedup.len(), kept.len(), "case {case}: a repeated draw");
                }
                place_draws(&mut tree, &draws);
                let verify = logits(tree.len(), &mut rng);
                let from = depths * budget;
                let lazy = walk_sampled_tree(&verify, &params, &q, &tree, &u, from).unwrap();
                let p =
                    rule_probs(&verify, params.temperature, params.top_k, params.top_p).unwrap();
                let table = TreeTable::new(&tree, &Device::Cpu).unwrap();
                let out = walk_tree_rows(&p, &q, &table, &u, from).unwrap();
                assert_eq!(
                    walk_outcome(&out.to_vec1().unwrap()),
                    lazy,
                    "{rule:?} case {case}"
                );
            }
        }
    }

    #[test]
    fn mismatched_inputs_are_refused_by_name() {
        let u = Uniforms::new(&[0.5; 4], &Device::Cpu).unwrap();
        let q = cpu(vec![0.5; 6], 2);
        let e = draw_distinct_rows(&q, &u, 0, 3).unwrap_err().to_string();
        assert!(e.contains("draw_distinct_rows"), "{e}");
        let tree = DraftTree::chain(0, &[1, 2]);
        let table = TreeTable::new(&tree, &Device::Cpu).unwrap();
        let p = cpu(vec![0.5; 6], 2);
        let e = walk_tree_rows(&p, &q, &table, &u, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("walk_tree_rows") && e.contains("3 nodes"), "{e}");
        let p = cpu(vec![0.5; 9], 3);
        let q1 = cpu(vec![0.5; 3], 1);
        let e = walk_tree_rows(&p, &q1, &table, &u, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("depth 1 has children"), "{e}");
    }
}

//! DDTree at T > 0, lossless with sampled candidates: the tree's shape from the drafter's
//! per-depth distributions, its tokens drawn without replacement, and the walk by recursive
//! rejection sampling over each node's children (multi-draft speculative sampling without
//! replacement, as in Jeon et al. 2024, "Recursive Speculative Decoding").
//!
//! **The tree.** The shape is DDTree's best-first tree ([`DraftTree::build`]) over the sorted
//! top-K probabilities of each depth's draft distribution `q_d` — a function of the `q`s only,
//! never of the draws. Each depth then draws, without replacement from `q_d`, as many tokens as
//! the shape has ranks there; the node of rank r at depth d gets the r-th draw. A node's
//! children are always ranks 0..m of their depth (best-first pushes a sibling only after its
//! elder), so they are the first m draws of one sequential draw without replacement.
//!
//! **The walk**, at a node whose target distribution is `p` (the request's rule on its verify
//! row) and whose children are `c_1 … c_m` drawn from `q`: for k = 1 … m, keep `c_k` with
//! probability min(1, p_k(c_k) / q_k(c_k)) and move to it; on a rejection
//! `p_{k+1} = norm(max(0, p_k − q_k))` and `q_{k+1}` is `q_k` without `c_k`, renormalised. When
//! every child is rejected the round ends with the bonus drawn from `p_{m+1}`; at a leaf, from
//! the target's own distribution. Why it is exact: given the draws so far, `c_k` is distributed
//! as `q_k`, so each stage outputs `p_k` by the rule of [`crate::acceptance`] with its fallback
//! outputting `p_{k+1}`; by induction the node outputs `p`. The number of children at a node
//! depends on the `q`s only, so including a child never selects on its draw (a shape chosen
//! from the draws would bias them). Depths are drawn independently of the target's randomness,
//! and one node per depth is visited.
//!
//! Why this rule rather than the exact match on top-K candidates: the exact match keeps a child
//! with probability p(c), which for one child is p(argmax q); the rule keeps the first child
//! with probability Σ min(p, q), which is larger whenever q is spread like p (T ≈ 1), and each
//! further child recovers part of the residual.
//!
//! Example: p = [.5, .3, .2], q = [.2, .6, .2], two children drawn: 1 then 0. Child 1 is kept
//! with probability .3 / .6 = .5; if rejected, p_2 = [.3, 0, 0] / .3 = [1, 0, 0] and
//! q_2 = [.2, 0, .2] / .4 = [.5, 0, .5], so child 0 is kept with probability 1.

use crate::sampling::{dense_probs, Sampler};
use crate::tree::{top_k_sorted, DraftTree};

/// A DDTree whose tokens were drawn from the drafter's distributions: the tree, and per depth
/// (index d − 1) the draft distribution `q_d` (dense) the tokens were drawn from.
#[derive(Debug, Clone)]
pub struct SampledTree {
    pub tree: DraftTree,
    pub qs: Vec<Vec<f32>>,
}

/// The outcome at one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeVerdict {
    /// The k-th child (0-based, in draw order) is kept.
    Accept(usize),
    /// Every child was rejected; the round ends with this bonus.
    Reject { bonus: u32 },
}

/// Zero `x[i]` and renormalise `x` in place (left as is when nothing remains).
fn remove_and_renormalise(x: &mut [f32], i: usize) {
    x[i] = 0.0;
    let s: f64 = x.iter().map(|&v| v as f64).sum();
    if s > 0.0 {
        x.iter_mut().for_each(|v| *v = (*v as f64 / s) as f32);
    }
}

/// The recursive rule at one node: `p` the target's distribution, `q` the children's draft
/// distribution, `children` their tokens in draw order, `uniform` the source of uniform numbers
/// (one per judged child, one for the bonus).
pub fn judge_node(
    p: &[f32],
    q: &[f32],
    children: &[u32],
    mut uniform: impl FnMut() -> f32,
) -> NodeVerdict {
    let (mut p, mut q) = (p.to_vec(), q.to_vec());
    for (k, &c) in children.iter().enumerate() {
        let (pc, qc) = (p[c as usize], q[c as usize]);
        let u = uniform();
        if qc > 0.0 && (pc >= qc || u < pc / qc) {
            return NodeVerdict::Accept(k);
        }
        let residual: Vec<f32> = p.iter().zip(&q).map(|(&a, &b)| (a - b).max(0.0)).collect();
        let mass: f64 = residual.iter().map(|&v| v as f64).sum();
        if mass > 0.0 {
            p = residual.iter().map(|&v| (v as f64 / mass) as f32).collect();
        }
        remove_and_renormalise(&mut q, c as usize);
    }
    let total: f64 = p.iter().map(|&v| v as f64).sum();
    NodeVerdict::Reject {
        bonus: crate::acceptance::pick_weighted(&p, total, uniform()),
    }
}

/// `k` tokens drawn one after another from `q` without replacement (each from what is left,
/// renormalised), each with the next of `uniform`; fewer when `q` has fewer tokens of non-zero
/// mass. Each draw walks the held tokens in token order with the ones drawn so far at weight 0:
/// the same sums and picks as over the tokens left, over the held tokens only (a vocabulary
/// head's q holds its subset). Example: q = [.5, 0, .5], k = 3, uniforms .7, .2 → token 2,
/// then token 0 (what is left is [.5, 0, 0]).
pub fn draws_without_replacement(
    q: &[f32],
    k: usize,
    mut uniform: impl FnMut() -> f32,
) -> Vec<u32> {
    let held: Vec<u32> = (0..q.len() as u32)
        .filter(|&t| q[t as usize] > 0.0)
        .collect();
    let mut w: Vec<f32> = held.iter().map(|&t| q[t as usize]).collect();
    let mut out: Vec<u32> = Vec::with_capacity(k.min(held.len()));
    while out.len() < k.min(held.len()) {
        let total: f64 = w.iter().map(|&x| x as f64).sum();
        let j = crate::acceptance::pick(w.iter().copied(), total, uniform()) as usize;
        out.push(held[j]);
        w[j] = 0.0;
    }
    out
}

/// The sampled tree's shape below `anchor`: DDTree's best-first tree of at most `budget` nodes
/// over each depth's top-K of its draft distribution (`tops[d]`, (token, q) best first, as
/// [`top_k_sorted`] gives them; tokens of zero mass are not ranked), each node's token standing
/// for its rank at its depth; and how many draws each depth needs (its highest rank + 1).
/// [`place_draws`] then gives each node its draw. Example: tops [[(4, .6), (9, .3)], [(2, .9)]],
/// budget 3 → nodes of ranks 0 and 1 at depth 1 and rank 0 at depth 2 below the first; draws
/// needed [2, 1].
pub fn sampled_shape(
    anchor: u32,
    tops: &[Vec<(u32, f32)>],
    budget: usize,
) -> (DraftTree, Vec<usize>) {
    // only the tokens q holds rank (ties in token order; a vocabulary head's q holds its
    // subset alone), ranked by q itself (ln is increasing) and only the top-K's logs taken
    let ranked: Vec<Vec<(u32, f32)>> = tops
        .iter()
        .map(|top| {
            top.iter()
                .filter(|&&(_, x)| x > 0.0)
                .enumerate()
                .map(|(r, &(_, x))| (r as u32, x.ln()))
                .collect()
        })
        .collect();
    let tree = DraftTree::build(anchor, &ranked, budget);
    let mut needed = vec![0usize; tops.len()];
    for i in 1..tree.len() {
        let d = tree.depths[i] - 1;
        needed[d] = needed[d].max(tree.tokens[i] as usize + 1);
    }
    (tree, needed)
}

/// Each node of a [`sampled_shape`] gets its depth's draw of its rank: the node of rank r at
/// depth d the r-th of `draws[d − 1]` (a depth's draws in draw order, at least as many as the
/// shape needs there).
pub fn place_draws(tree: &mut DraftTree, draws: &[Vec<u32>]) {
    for i in 1..tree.len() {
        tree.tokens[i] = draws[tree.depths[i] - 1][tree.tokens[i] as usize];
    }
}

/// The walk down a sampled tree by [`judge_node`] at every node reached: `q_at(d)` is the
/// draft distribution of depth d + 1 (the children of a node at depth d were drawn from it),
/// `p_at(row)` the target's distribution at a tree row (the request's rule on its verify row;
/// called once per visited row, in order), `uniform` one number per judged child and one for
/// the bonus. At a leaf the bonus is drawn from the leaf's `p`. Returns the accepted path (tree
/// rows, root excluded) and the bonus. One implementation for the host's walk and the
/// device's walk's CPU twin.
pub fn walk_judged<'q, E>(
    tree: &DraftTree,
    q_at: impl Fn(usize) -> &'q [f32],
    mut p_at: impl FnMut(usize) -> Result<Vec<f32>, E>,
    mut uniform: impl FnMut() -> f32,
) -> Result<(Vec<usize>, u32), E> {
    let (mut cur, mut path) = (0, Vec::new());
    loop {
        let children: Vec<usize> = tree.children(cur).collect();
        let p = p_at(cur)?;
        if children.is_empty() {
            let total: f64 = p.iter().map(|&v| v as f64).sum();
            return Ok((path, crate::acceptance::pick_weighted(&p, total, uniform())));
        }
        let tokens: Vec<u32> = children.iter().map(|&c| tree.tokens[c]).collect();
        match judge_node(&p, q_at(tree.depths[cur]), &tokens, &mut uniform) {
            NodeVerdict::Accept(k) => {
                cur = children[k];
                path.push(cur);
            }
            NodeVerdict::Reject { bonus } => return Ok((path, bonus)),
        }
    }
}

impl Sampler {
    /// [`draws_without_replacement`] with this generation's stream.
    pub fn draw_without_replacement(&mut self, q: &[f32], k: usize) -> Vec<u32> {
        draws_without_replacement(q, k, || self.uniform())
    }

    /// The sampled DDTree of at most `budget` nodes below `anchor`, from the drafter's
    /// distribution of each depth (`qs[d]` for depth d + 1, dense over the vocabulary, under
    /// the request's rule: [`Sampler::draft_distribution`]); the shape from the top `top_k` of
    /// each depth's `q` ([`sampled_shape`]), then each depth's draws.
    pub fn sampled_tree(
        &mut self,
        anchor: u32,
        qs: Vec<Vec<f32>>,
        budget: usize,
        top_k: usize,
    ) -> SampledTree {
        let tops: Vec<Vec<(u32, f32)>> = qs.iter().map(|q| top_k_sorted(q, top_k)).collect();
        let (mut tree, needed) = sampled_shape(anchor, &tops, budget);
        let draws: Vec<Vec<u32>> = qs
            .iter()
            .zip(&needed)
            .map(|(q, &n)| self.draw_without_replacement(q, n))
            .collect();
        place_draws(&mut tree, &draws);
        SampledTree { tree, qs }
    }

    /// Walk a sampled tree with the target's logits of each verify row (`logits_at(row)`):
    /// [`walk_judged`] with each visited row's distribution under the request's rule and this
    /// generation's stream.
    pub fn walk_sampled_tree<E>(
        &mut self,
        st: &SampledTree,
        mut logits_at: impl FnMut(usize) -> Result<Vec<f32>, E>,
    ) -> Result<(Vec<usize>, u32), E> {
        let params = self.params;
        walk_judged(
            &st.tree,
            |d| &st.qs[d],
            |r| Ok(dense_probs(&logits_at(r)?, &params)),
            || self.uniform(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acceptance::{judge, Verdict};
    use crate::sampling::SamplingParams;

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams::new(1.0, 1.0, 0, seed).unwrap())
    }

    /// One node with 1, 2 and 3 children drawn without replacement from q: the output is
    /// distributed as p (400,000 trials, within 5 standard deviations), and more children accept
    /// more.
    #[test]
    fn one_node_gives_the_target_distribution() {
        let p = [0.45f32, 0.25, 0.15, 0.1, 0.05, 0.0];
        let q = [0.05f32, 0.4, 0.1, 0.05, 0.2, 0.2];
        let mut rates = Vec::new();
        for m in 1..=3 {
            let mut s = sampler(11 + m as u64);
            let n = 400_000;
            let mut counts = [0usize; 6];
            let mut kept = 0;
            for _ in 0..n {
                let children = s.draw_without_replacement(&q, m);
                let t = match judge_node(&p, &q, &children, || s.uniform()) {
                    NodeVerdict::Accept(k) => {
                        kept += 1;
                        children[k]
                    }
                    NodeVerdict::Reject { bonus } => bonus,
                };
                counts[t as usize] += 1;
            }
            crate::acceptance::assert_distributed_as(&counts, &p, &format!("{m} children"));
            rates.push(kept as f64 / n as f64);
        }
        // one child: Σ min(p, q)
        let one: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b) as f64).sum();
        assert!((rates[0] - one).abs() < 5e-3, "{rates:?} vs {one}");
        assert!(rates[0] < rates[1] && rates[1] < rates[2], "{rates:?}");
    }

    /// With one child the node rule is the chain's rule (`judge`), uniform for uniform.
    #[test]
    fn one_child_is_the_chain_rule() {
        let (p, q) = ([0.5f32, 0.3, 0.2], [0.2f32, 0.6, 0.2]);
        for (ua, ub) in [(0.49, 0.9), (0.51, 0.9), (0.99, 0.1)] {
            for d in 0..3u32 {
                let mut us = [ua, ub].into_iter();
                let node = judge_node(&p, &q, &[d], || us.next().unwrap());
                let chain = match judge(&p, &q, d, ua, ub) {
                    Verdict::Accept => NodeVerdict::Accept(0),
                    Verdict::Reject { bonus } => NodeVerdict::Reject { bonus },
                };
                assert_eq!(node, chain, "draft {d}, u {ua} {ub}");
            }
        }
    }

    #[test]
    fn the_module_example() {
        let (p, q) = ([0.5f32, 0.3, 0.2], [0.2f32, 0.6, 0.2]);
        let mut us = [0.51f32, 0.999].into_iter();
        assert_eq!(
            judge_node(&p, &q, &[1, 0], || us.next().unwrap()),
            NodeVerdict::Accept(1)
        );
    }

    /// The shape comes from the q's alone (the same for every seed), and every node's children
    /// are distinct tokens their q gives mass.
    #[test]
    fn shape_from_q_tokens_from_draws() {
        let qs = vec![
            vec![0.5f32, 0.3, 0.2, 0.0],
            vec![0.1f32, 0.1, 0.4, 0.4],
            vec![0.25f32; 4],
        ];
        let shapes: Vec<(Vec<Option<usize>>, Vec<usize>)> = (0..20)
            .map(|seed| {
                let st = sampler(seed).sampled_tree(7, qs.clone(), 6, 3);
                let t = &st.tree;
                assert_eq!(t.tokens[0], 7);
                for node in 0..t.len() {
                    let kids: Vec<u32> = t.children(node).map(|c| t.tokens[c]).collect();
                    let mut dedup = kids.clone();
                    dedup.sort();
                    dedup.dedup();
                    assert_eq!(dedup.len(), kids.len(), "seed {seed}: repeated child");
                    for c in t.children(node) {
                        assert!(qs[t.depths[c] - 1][t.tokens[c] as usize] > 0.0);
                    }
                }
                (t.parents.clone(), t.depths.clone())
            })
            .collect();
        assert!(shapes.iter().all(|s| *s == shapes[0]));
        assert_eq!(shapes[0].0.len(), 7);
    }

    /// The draws walk q with the drawn tokens at weight 0 and pick what drawing from the list
    /// of tokens left picks, uniform for uniform: the list rebuilt for each draw (the rule as
    /// first written) gives the same tokens for the same seed, zeros, ties and more draws than
    /// held tokens included.
    #[test]
    fn draws_equal_drawing_from_the_tokens_left() {
        let list_draws = |s: &mut Sampler, q: &[f32], k: usize| {
            let mut left: Vec<(u32, f32)> = q
                .iter()
                .enumerate()
                .filter(|(_, &x)| x > 0.0)
                .map(|(t, &x)| (t as u32, x))
                .collect();
            let mut out = Vec::new();
            while out.len() < k && !left.is_empty() {
                let w: Vec<f32> = left.iter().map(|&(_, x)| x).collect();
                let total: f64 = w.iter().map(|&x| x as f64).sum();
                let at = crate::acceptance::pick_weighted(&w, total, s.uniform());
                out.push(left.remove(at as usize).0);
            }
            out
        };
        let qs = [
            vec![0.0f32, 0.3, 0.0, 0.3, 0.2, 0.0, 0.2, 0.0],
            vec![0.1f32; 10],
            (0..1000)
                .map(|i| ((i * 37 % 101) as f32).powi(3) * 1e-9)
                .collect(),
        ];
        for q in &qs {
            for k in [1, 2, 5, 20] {
                for seed in 0..20 {
                    let want = list_draws(&mut sampler(seed), q, k);
                    let got = sampler(seed).draw_without_replacement(q, k);
                    assert_eq!(got, want, "k {k}, seed {seed}");
                }
            }
        }
    }

    /// Ranking only the tokens q holds gives the shape that ranking the whole vocabulary by
    /// ln q gives (zeros at −∞, dropped), ties included: q's of a vocabulary subset with tied
    /// values, budgets that take every held token and more.
    #[test]
    fn the_shape_ranks_the_held_tokens_as_the_whole_vocabulary_would() {
        let qs = vec![
            vec![0.0f32, 0.3, 0.0, 0.3, 0.2, 0.0, 0.2, 0.0],
            vec![0.0f32, 0.0, 0.5, 0.25, 0.0, 0.25, 0.0, 0.0],
            vec![0.0f32, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5, 0.0],
        ];
        for (budget, top_k) in [(4, 2), (6, 3), (12, 8), (30, 8)] {
            let whole: Vec<Vec<(u32, f32)>> = qs
                .iter()
                .map(|q| {
                    let logq: Vec<f32> = q.iter().map(|&x| x.ln()).collect();
                    top_k_sorted(&logq, top_k)
                        .into_iter()
                        .filter(|&(_, l)| l > f32::NEG_INFINITY)
                        .enumerate()
                        .map(|(r, (_, l))| (r as u32, l))
                        .collect()
                })
                .collect();
            let want = DraftTree::build(5, &whole, budget);
            let got = sampler(3).sampled_tree(5, qs.clone(), budget, top_k).tree;
            assert_eq!(
                (&got.parents, &got.depths),
                (&want.parents, &want.depths),
                "budget {budget}, top-k {top_k}"
            );
        }
    }
}

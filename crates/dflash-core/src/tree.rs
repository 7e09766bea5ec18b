//! Draft trees (DDTree, arXiv 2604.12989) and the acceptance walk shared with chains.
//!
//! A [`DraftTree`] has the anchor as root (row 0) and nodes numbered so every parent precedes
//! its children. A DFlash chain is the degenerate tree `parents = [-, 0, 1, 2, …]`, so one
//! verify (tree mask, positions `anchor + depth`) and one walk serve both modes.
//!
//! [`DraftTree::build`] is DDTree's best-first construction: from per-depth top-K
//! log-probabilities it pops, from a max-heap keyed by cumulative log-probability, the best
//! remaining prefix; popping node (depth d, rank r, parent p) pushes its next sibling
//! (d, r+1, p) and its first child (d+1, 0, itself). Since log-probabilities are ≤ 0 and ranks
//! are sorted, a prefix is always popped before its extensions: the N nodes are the N most
//! probable prefixes under the drafter's per-position (independent) distributions.
//! Example: depth-1 top-2 = (a: -0.1, b: -2.0), depth-2 top-2 = (c: -0.2, d: -1.0), N = 3 →
//! nodes a (-0.1), a→c (-0.3), a→d (-1.1); b (-2.0) is not in the tree.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::visibility::{tree as tree_visibility, Visibility};

#[derive(Debug, Clone, PartialEq)]
pub struct DraftTree {
    /// `tokens[0]` is the anchor (root); `tokens[i]` for i ≥ 1 are drafted nodes.
    pub tokens: Vec<u32>,
    /// `parents[0] = None`; every other node's parent has a smaller index.
    pub parents: Vec<Option<usize>>,
    /// Depth of each node (root 0).
    pub depths: Vec<usize>,
}

/// The top `k` (token, value) pairs of one row, sorted by value descending, ties by token id
/// ascending: DDTree's per-position candidates from a row of log-probabilities (the drafter's
/// log-softmax, computed on its device). Example: [1, 3, 2, 3], k 3 → tokens [1, 3, 2].
pub fn top_k_sorted(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(values.len());
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    if k == 0 {
        return Vec::new();
    }
    if k <= 64 {
        return top_k_scan(values, k);
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

/// [`top_k_sorted`] for a small `k` in one pass: the best `k` so far, kept sorted (a value
/// not above the k-th is skipped, the common case). Example: `[0.1, 0.5, 0.5, 0.2]`, k = 2 →
/// `[(1, 0.5), (2, 0.5)]` (equal values: the lower index first).
fn top_k_scan(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        if best.len() == k && v.total_cmp(&best[k - 1].1) != Ordering::Greater {
            continue;
        }
        // after every kept value ≥ v (equal ones have lower indices)
        let p = best.partition_point(|&(_, b)| b.total_cmp(&v) != Ordering::Less);
        best.insert(p, (i as u32, v));
        best.truncate(k);
    }
    best
}

#[derive(Debug)]
struct Candidate {
    score: f64,
    seq: u64,
    depth: usize,
    rank: usize,
    parent: usize,
}
impl PartialEq for Candidate {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Candidate {
    /// Higher score first; ties go to the earlier-pushed candidate (deterministic).
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.seq.cmp(&self.seq))
    }
}

impl DraftTree {
    /// The chain `anchor → d1 → d2 → …`.
    pub fn chain(anchor: u32, drafts: &[u32]) -> Self {
        let n = drafts.len() + 1;
        let mut tokens = vec![anchor];
        tokens.extend_from_slice(drafts);
        Self {
            tokens,
            parents: (0..n).map(|i| i.checked_sub(1)).collect(),
            depths: (0..n).collect(),
        }
    }

    /// DDTree's best-first tree of at most `budget` non-root nodes. `top[d]` holds the
    /// sorted top-K (token, log-prob) of depth d+1 (see [`top_k_sorted`]).
    pub fn build(anchor: u32, top: &[Vec<(u32, f32)>], budget: usize) -> Self {
        Self::build_conditional(anchor, top.len(), budget, |depth, _| top[depth - 1].clone())
    }

    /// The best-first construction when a node's children depend on the node: `children(d,
    /// parent)` gives the sorted (token, log-prob) candidates at depth `d` (1-based) below a
    /// node whose token is `parent` (the anchor for depth 1), at most `max_depth` deep. With
    /// per-depth lists that ignore `parent` this is [`Self::build`]; DFlash2's selector gives
    /// each parent its own ranking ([`crate::selector`]). Each node's list is asked for once.
    pub fn build_conditional(
        anchor: u32,
        max_depth: usize,
        budget: usize,
        children: impl FnMut(usize, u32) -> Vec<(u32, f32)>,
    ) -> Self {
        Self::build_scored(anchor, max_depth, budget, children).0
    }

    /// [`Self::build_conditional`] with each node's cumulative log-probability (the root's 0),
    /// in node order, which is non-increasing: the first `b + 1` nodes are the tree of budget
    /// `b`. Example: the module's example → scores [0, −0.1, −0.3, −1.1].
    pub fn build_scored(
        anchor: u32,
        max_depth: usize,
        budget: usize,
        mut children: impl FnMut(usize, u32) -> Vec<(u32, f32)>,
    ) -> (Self, Vec<f64>) {
        let mut t = Self {
            tokens: vec![anchor],
            parents: vec![None],
            depths: vec![0],
        };
        let mut scores = vec![0f64];
        if max_depth == 0 || budget == 0 {
            return (t, scores);
        }
        // the candidate list below each node, once asked for
        let mut lists: Vec<Vec<(u32, f32)>> = vec![children(1, anchor)];
        if lists[0].is_empty() {
            return (t, scores);
        }
        let mut heap = BinaryHeap::new();
        let mut seq = 0u64;
        let mut push = |heap: &mut BinaryHeap<Candidate>,
                        score: f64,
                        depth: usize,
                        rank: usize,
                        parent: usize| {
            heap.push(Candidate {
                score,
                seq,
                depth,
                rank,
                parent,
            });
            seq += 1;
        };
        push(&mut heap, lists[0][0].1 as f64, 1, 0, 0);
        while t.tokens.len() <= budget {
            let Some(c) = heap.pop() else { break };
            let (token, logp) = lists[c.parent][c.rank];
            let next = lists[c.parent].get(c.rank + 1).copied();
            let node = t.tokens.len();
            t.tokens.push(token);
            t.parents.push(Some(c.parent));
            t.depths.push(c.depth);
            scores.push(c.score);
            if let Some((_, next_logp)) = next {
                let s = c.score - logp as f64 + next_logp as f64;
                push(&mut heap, s, c.depth, c.rank + 1, c.parent);
            }
            let below = if c.depth < max_depth {
                children(c.depth + 1, token)
            } else {
                Vec::new()
            };
            if let Some(&(_, first)) = below.first() {
                push(&mut heap, c.score + first as f64, c.depth + 1, 0, node);
            }
            lists.push(below);
        }
        (t, scores)
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Children of `node`, in index order.
    pub fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        (node + 1..self.len()).filter(move |&i| self.parents[i] == Some(node))
    }

    /// Absolute positions of the rows when the anchor sits at `anchor_pos`.
    pub fn positions(&self, anchor_pos: usize) -> Vec<usize> {
        self.depths.iter().map(|d| anchor_pos + d).collect()
    }

    /// The verify mask over `[cache | tree rows]`: ancestor-only.
    pub fn visibility(&self, cache_len: usize) -> Visibility {
        tree_visibility(cache_len, &self.parents)
    }

    /// The acceptance walk. `sample_at(row)` is the target's own token at tree row `row`
    /// (called once per visited row, in order). From the root: while the target's token
    /// equals the token of a child of the current row, move to that child. Returns the
    /// accepted path (tree rows, root excluded) and the bonus (the target's token at the
    /// last row reached).
    /// Example: chain [x, a, b, c], target tokens a, b, z → path [1, 2], bonus z.
    pub fn walk<E>(
        &self,
        mut sample_at: impl FnMut(usize) -> Result<u32, E>,
    ) -> Result<(Vec<usize>, u32), E> {
        let mut cur = 0;
        let mut path = Vec::new();
        loop {
            let t = sample_at(cur)?;
            match self.children(cur).find(|&c| self.tokens[c] == t) {
                Some(c) => {
                    path.push(c);
                    cur = c;
                }
                None => return Ok((path, t)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_top(rng: &mut ChaCha8Rng, depth: usize, vocab: usize) -> Vec<Vec<(u32, f32)>> {
        (0..depth)
            .map(|_| {
                let logits: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>() * 4.0).collect();
                let lse = logits.iter().map(|&x| x.exp()).sum::<f32>().ln();
                let logprobs: Vec<f32> = logits.iter().map(|&x| x - lse).collect();
                top_k_sorted(&logprobs, vocab)
            })
            .collect()
    }

    /// All prefixes (as token paths) with their scores, by brute force.
    fn all_prefixes(top: &[Vec<(u32, f32)>]) -> Vec<(Vec<u32>, f64)> {
        let mut out = Vec::new();
        let mut frontier: Vec<(Vec<u32>, f64)> = vec![(vec![], 0.0)];
        for row in top {
            let mut next = Vec::new();
            for (p, s) in &frontier {
                for &(t, lp) in row {
                    let mut q = p.clone();
                    q.push(t);
                    next.push((q, s + lp as f64));
                }
            }
            out.extend(next.iter().cloned());
            frontier = next;
        }
        out
    }

    fn node_path(t: &DraftTree, mut i: usize) -> Vec<u32> {
        let mut p = Vec::new();
        while let Some(par) = t.parents[i] {
            p.push(t.tokens[i]);
            i = par;
        }
        p.reverse();
        p
    }

    #[test]
    fn builder_returns_the_best_prefixes() {
        for seed in 0..200u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let depth = 1 + (seed as usize % 4);
            let vocab = 2 + (seed as usize % 4);
            let top = random_top(&mut rng, depth, vocab);
            let mut all = all_prefixes(&top);
            all.sort_by(|a, b| b.1.total_cmp(&a.1));
            let budget = 1 + (seed as usize * 7) % all.len();
            let t = DraftTree::build(9, &top, budget);
            assert_eq!(t.len() - 1, budget.min(all.len()), "seed {seed}");
            let mut got: Vec<Vec<u32>> = (1..t.len()).map(|i| node_path(&t, i)).collect();
            let mut want: Vec<Vec<u32>> = all[..budget].iter().map(|p| p.0.clone()).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "seed {seed}");
            for i in 1..t.len() {
                let p = t.parents[i].unwrap();
                assert!(p < i, "parents first");
                assert_eq!(t.depths[i], t.depths[p] + 1);
            }
        }
    }

    #[test]
    fn doc_example() {
        let top = vec![vec![(1, -0.1), (2, -2.0)], vec![(3, -0.2), (4, -1.0)]];
        let t = DraftTree::build(0, &top, 3);
        assert_eq!(t.tokens, vec![0, 1, 3, 4]);
        assert_eq!(t.parents, vec![None, Some(0), Some(1), Some(1)]);
    }

    #[test]
    fn budget_one_per_depth_top1_is_a_chain() {
        // with every top-1 near-certain, the best budget-D tree is the top-1 chain
        let top: Vec<Vec<(u32, f32)>> = (0..5).map(|d| vec![(10 + d, -1e-4), (99, -9.0)]).collect();
        let t = DraftTree::build(7, &top, 5);
        assert_eq!(t, DraftTree::chain(7, &[10, 11, 12, 13, 14]));
    }

    #[test]
    fn walk_follows_matching_children() {
        let t = DraftTree::chain(0, &[5, 6, 7]);
        let target = [5u32, 6, 9, 0];
        let (path, bonus) = t.walk::<()>(|r| Ok(target[r])).unwrap();
        assert_eq!((path, bonus), (vec![1, 2], 9));
        // a tree: root → {1: a, 2: b}, 2 → {3: c}
        let t = DraftTree {
            tokens: vec![0, 11, 12, 13],
            parents: vec![None, Some(0), Some(0), Some(2)],
            depths: vec![0, 1, 1, 2],
        };
        let target = [12u32, 0, 13, 42];
        let (path, bonus) = t.walk::<()>(|r| Ok(target[r])).unwrap();
        assert_eq!((path, bonus), (vec![2, 3], 42));
    }

    #[test]
    fn top_k_is_sorted_with_ties_by_token() {
        let l = [1.0f32, 3.0, 2.0, 3.0];
        let t = top_k_sorted(&l, 3);
        assert_eq!(t, vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        assert_eq!(top_k_sorted(&l, 9).len(), 4);
        assert!(top_k_sorted(&l, 0).is_empty());
    }

    /// The one-pass scan (k ≤ 64) and the selection (larger k) against a full sort by (value
    /// descending, index ascending), on values with many ties, a NaN and infinities.
    #[test]
    fn both_top_k_paths_equal_a_full_sort() {
        let mut s = 7u32;
        let mut values: Vec<f32> = (0..3000)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 20) % 200) as f32 * -0.25 // 200 distinct values: ties everywhere
            })
            .collect();
        values[17] = f32::INFINITY;
        values[18] = f32::NEG_INFINITY;
        values[2999] = f32::NAN;
        values[5] = 0.0;
        let mut all: Vec<u32> = (0..values.len() as u32).collect();
        all.sort_by(|a, b| {
            values[*b as usize]
                .total_cmp(&values[*a as usize])
                .then(a.cmp(b))
        });
        for k in [1usize, 2, 8, 32, 64, 65, 200, 3000] {
            let want: Vec<(u32, f32)> = all[..k].iter().map(|&i| (i, values[i as usize])).collect();
            let got = top_k_sorted(&values, k);
            assert_eq!(got.len(), k);
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.0, w.0, "k {k}");
                assert_eq!(g.1.to_bits(), w.1.to_bits(), "k {k}");
            }
            if k <= 64 {
                assert_eq!(top_k_scan(&values, k).len(), k);
            }
        }
    }
}

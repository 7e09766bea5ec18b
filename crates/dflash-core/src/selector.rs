//! DFlash2's candidate selector (z-lab `dflash==0.1.0`, `CandidateSelector.select`): the rule
//! that turns a block's draft logits into drafts, written once for the chain at T = 0, the
//! chain at T > 0 and DDTree.
//!
//! Per drafted position p the candidates are the top `selector_top_k` tokens of the draft
//! logits (after `output_multiplier` and soft-capping), each with its logit as the **unary**
//! score. A candidate `c` after the predecessor token `prev` scores
//! `unary(c) + ⟨A[prev] ⊙ hp_p, B[c]⟩` (A, B: the predecessor and successor codebooks,
//! `hp_p`: the position's hidden row through `hidden_projection`); the model computes that
//! **edge** term for every (predecessor candidate, candidate) pair ([`SelectorStep::edge`]).
//! The walk starts from the anchor (the predecessor of position 0) and goes left to right:
//! - T = 0: the best score (the first in candidate order on a tie);
//! - T > 0: a draw from `softmax(scores / T)` over the candidates alone (the request's top-p
//!   and top-k are not applied, as in z-lab); that `q` — zero off the candidates — is the
//!   draft distribution the rejection rule of [`crate::acceptance`] judges against, exactly
//!   z-lab's `_rejection_sample` with `draft_indices`;
//! - DDTree: below a node, the candidates ranked by `log_softmax(scores)` given the node's token
//!   ([`children`]), so the best-first tree holds the most probable prefixes under the
//!   selector's own chain distribution.
//!
//! Example: candidates at p = 0 `[7, 3]` with unary `[2.0, 1.5]` and edge after the anchor
//! `[0.0, 1.0]` → scores `[2.0, 2.5]`, draft 3; at p = 1 the edge row is the one of
//! predecessor index 1 (token 3).

use crate::acceptance::pick_weighted;
use crate::sampling::Sampler;

/// One drafted position: its candidates (best unary first), their unary scores, and the edge
/// term `[predecessors, candidates]` row-major, where the predecessors are the anchor (one row,
/// position 0) or the previous position's candidates in their order.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectorStep {
    pub tokens: Vec<u32>,
    pub unary: Vec<f32>,
    pub edge: Vec<f32>,
}

impl SelectorStep {
    /// The candidates' scores after the predecessor of index `prev` (0 for the anchor).
    pub fn scores(&self, prev: usize) -> Vec<f32> {
        let k = self.tokens.len();
        let e = &self.edge[prev * k..(prev + 1) * k];
        self.unary.iter().zip(e).map(|(&u, &x)| u + x).collect()
    }

    /// The index of `token` among the candidates.
    pub fn index_of(&self, token: u32) -> Option<usize> {
        self.tokens.iter().position(|&t| t == token)
    }
}

/// The greedy walk (T = 0): the drafts, one per step.
pub fn walk_greedy(steps: &[SelectorStep]) -> Vec<u32> {
    let mut prev = 0;
    steps
        .iter()
        .map(|s| {
            prev = crate::sampling::argmax(&s.scores(prev)) as usize;
            s.tokens[prev]
        })
        .collect()
}

/// `softmax(x / t)` in f32 (max subtracted), as z-lab's `_sampling_probs` without filters.
fn softmax_t(x: &[f32], t: f64) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x
        .iter()
        .map(|&v| (((v - m) as f64) / t).exp() as f32)
        .collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// The drafts of a sampled walk and, per position, the draft distribution they were drawn
/// from, dense over the vocabulary (zero off the candidates).
#[derive(Debug, Clone, PartialEq)]
pub struct SelectorDraw {
    pub tokens: Vec<u32>,
    pub qs: Vec<Vec<f32>>,
}

impl Sampler {
    /// The sampled walk (T > 0, the request's temperature): one uniform number per position.
    pub fn walk_selector(&mut self, steps: &[SelectorStep], vocab: usize) -> SelectorDraw {
        let t = self.params.temperature as f64;
        let mut prev = 0;
        let (mut tokens, mut qs) = (Vec::new(), Vec::new());
        for s in steps {
            let q = softmax_t(&s.scores(prev), t);
            let sum = q.iter().map(|&x| x as f64).sum();
            prev = pick_weighted(&q, sum, self.uniform()) as usize;
            tokens.push(s.tokens[prev]);
            let mut dense = vec![0.0f32; vocab];
            for (&tok, &p) in s.tokens.iter().zip(&q) {
                dense[tok as usize] = p;
            }
            qs.push(dense);
        }
        SelectorDraw { tokens, qs }
    }
}

/// DDTree's candidates at `depth` (1-based) below a node whose token is `parent` (the anchor
/// at depth 1): the step's candidates by `log_softmax(scores)` after that predecessor, best
/// first (ties by candidate order). Empty when `parent` is not a candidate of the depth above.
pub fn children(steps: &[SelectorStep], depth: usize, parent: u32) -> Vec<(u32, f32)> {
    let step = &steps[depth - 1];
    let prev = if depth == 1 {
        Some(0)
    } else {
        steps[depth - 2].index_of(parent)
    };
    let Some(prev) = prev else {
        return Vec::new();
    };
    let scores = step.scores(prev);
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + scores.iter().map(|&v| (v - m).exp()).sum::<f32>().ln();
    let mut out: Vec<(u32, f32)> = step
        .tokens
        .iter()
        .zip(&scores)
        .map(|(&t, &v)| (t, v - lse))
        .collect();
    // stable: equal log-probs keep candidate order
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use crate::tree::DraftTree;

    fn steps() -> Vec<SelectorStep> {
        vec![
            SelectorStep {
                tokens: vec![7, 3],
                unary: vec![2.0, 1.5],
                edge: vec![0.0, 1.0],
            },
            SelectorStep {
                tokens: vec![4, 5],
                unary: vec![1.0, 0.0],
                // after 7: [0, 3]; after 3: [0, -1]
                edge: vec![0.0, 3.0, 0.0, -1.0],
            },
        ]
    }

    #[test]
    fn greedy_walk_uses_the_chosen_predecessor() {
        // p0: scores [2.0, 2.5] → 3 (index 1); p1 after 3: [1.0, -1.0] → 4. Without the edge
        // term the drafts would be 7 then 4; after 7 they would be 7 then 5.
        assert_eq!(walk_greedy(&steps()), vec![3, 4]);
        let tie = SelectorStep {
            tokens: vec![9, 8],
            unary: vec![1.0, 1.0],
            edge: vec![0.0, 0.0],
        };
        assert_eq!(
            walk_greedy(&[tie]),
            vec![9],
            "a tie goes to the first candidate"
        );
    }

    /// The sampled walk draws each position from softmax(scores / T) after the drawn
    /// predecessor, and reports that distribution: pair frequencies over 200,000 walks agree
    /// with the chain's product of conditionals.
    #[test]
    fn sampled_walk_is_distributed_as_the_chain() {
        let st = steps();
        let t = 0.7;
        let mut s = Sampler::new(SamplingParams::new(t, 1.0, 0, 11).unwrap());
        let mut counts = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            let d = s.walk_selector(&st, 10);
            let i0 = st[0].index_of(d.tokens[0]).unwrap();
            let i1 = st[1].index_of(d.tokens[1]).unwrap();
            // the reported q is the conditional the token was drawn from
            let q1 = softmax_t(&st[1].scores(i0), t);
            assert_eq!(d.qs[1][st[1].tokens[0] as usize], q1[0]);
            assert_eq!(d.qs[1].iter().filter(|&&x| x > 0.0).count(), 2);
            counts[i0 * 2 + i1] += 1;
        }
        let q0 = softmax_t(&st[0].scores(0), t);
        let want: Vec<f32> = (0..4)
            .map(|c| q0[c / 2] * softmax_t(&st[1].scores(c / 2), t)[c % 2])
            .collect();
        crate::acceptance::assert_distributed_as(&counts, &want, "selector chain");
    }

    #[test]
    fn tree_children_follow_the_parent() {
        let st = steps();
        let root = children(&st, 1, 99);
        assert_eq!(root[0].0, 3, "after the anchor, 3 scores best");
        let after7 = children(&st, 2, 7);
        let after3 = children(&st, 2, 3);
        assert_eq!(after7[0].0, 5);
        assert_eq!(after3[0].0, 4);
        assert!(children(&st, 2, 42).is_empty());
        let p: f32 = after7.iter().map(|c| c.1.exp()).sum();
        assert!((p - 1.0).abs() < 1e-6);
        // budget 3: 3 (best root), then the best of {7, 3→4, ...}
        let tree = DraftTree::build_conditional(99, 2, 3, |d, parent| children(&st, d, parent));
        assert_eq!(tree.tokens[..2], [99, 3]);
        let lp = |d: usize, par: u32, tok: u32| {
            children(&st, d, par)
                .into_iter()
                .find(|c| c.0 == tok)
                .unwrap()
                .1
        };
        // the three best prefixes by the chain's log-probability, computed by hand
        let mut prefixes = [
            (lp(1, 99, 3), vec![3]),
            (lp(1, 99, 7), vec![7]),
            (lp(1, 99, 3) + lp(2, 3, 4), vec![3, 4]),
            (lp(1, 99, 3) + lp(2, 3, 5), vec![3, 5]),
            (lp(1, 99, 7) + lp(2, 7, 4), vec![7, 4]),
            (lp(1, 99, 7) + lp(2, 7, 5), vec![7, 5]),
        ];
        prefixes.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut got: Vec<Vec<u32>> = (1..tree.len())
            .map(|n| {
                let mut path = vec![tree.tokens[n]];
                let mut p = tree.parents[n];
                while let Some(x) = p.filter(|&x| x > 0) {
                    path.insert(0, tree.tokens[x]);
                    p = tree.parents[x];
                }
                path
            })
            .collect();
        let mut want: Vec<Vec<u32>> = prefixes[..3].iter().map(|p| p.1.clone()).collect();
        got.sort();
        want.sort();
        assert_eq!(got, want);
    }
}

//! Training rows: one sequence, or several packed side by side into one row of at most
//! `pack_length` tokens so that one target forward and one drafter forward serve them all
//! (the GPU is launch-bound on one ~400-token sequence). Packing changes no number: each
//! sequence keeps its positions, its target attention, its draft context and its labels
//! ([`dflash_core::segments`]); only anchors are drawn per row instead of per sequence.
//!
//! Example, pack_length 1000, sequences of 600, 300, 500 tokens in that order → rows
//! [600 + 300] and [500].

use dflash_core::segments::Segments;

use crate::data::Sequence;

#[derive(Debug, Clone, PartialEq)]
pub struct TrainingRow {
    /// The sequences' ids and loss masks, concatenated.
    pub seq: Sequence,
    pub segs: Segments,
}

impl TrainingRow {
    pub fn single(seq: Sequence) -> Self {
        let segs = Segments::single(seq.ids.len());
        Self { seq, segs }
    }

    /// One sequence supervised at every position (the doctor's probes on canary prompts).
    pub fn fully_supervised(ids: &[u32]) -> Self {
        Self::single(Sequence {
            ids: ids.to_vec(),
            loss_mask: vec![1; ids.len()],
        })
    }

    fn from_parts(parts: &[&Sequence]) -> Self {
        let mut seq = Sequence {
            ids: Vec::new(),
            loss_mask: Vec::new(),
        };
        for p in parts {
            seq.ids.extend_from_slice(&p.ids);
            seq.loss_mask.extend_from_slice(&p.loss_mask);
        }
        let lengths: Vec<usize> = parts.iter().map(|p| p.ids.len()).collect();
        Self {
            seq,
            segs: Segments::from_lengths(&lengths),
        }
    }

    pub fn len(&self) -> usize {
        self.seq.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seq.ids.is_empty()
    }

    /// Anchor candidates: a supervised row followed by a supervised row of the same sequence.
    pub fn anchor_candidates(&self) -> Vec<usize> {
        crate::anchors::candidates(&self.seq.loss_mask)
            .into_iter()
            .filter(|&a| self.segs.bounds(a).1 > a + 1)
            .collect()
    }
}

/// Pack `seqs` in the given `order`, greedily: a row takes sequences while their total stays
/// within `length` (a longer sequence gets a row of its own).
pub fn pack(seqs: &[Sequence], order: &[usize], length: usize) -> Vec<TrainingRow> {
    let mut rows = Vec::new();
    let mut cur: Vec<&Sequence> = Vec::new();
    let mut cur_len = 0;
    for &i in order {
        let s = &seqs[i];
        if !cur.is_empty() && cur_len + s.ids.len() > length {
            rows.push(TrainingRow::from_parts(&cur));
            cur.clear();
            cur_len = 0;
        }
        cur.push(s);
        cur_len += s.ids.len();
    }
    if !cur.is_empty() {
        rows.push(TrainingRow::from_parts(&cur));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, first_supervised: usize) -> Sequence {
        Sequence {
            ids: (0..n as u32).collect(),
            loss_mask: (0..n).map(|i| (i >= first_supervised) as u8).collect(),
        }
    }

    #[test]
    fn packs_greedily_and_keeps_anchors_inside_sequences() {
        let seqs = vec![seq(600, 100), seq(300, 0), seq(500, 10)];
        let rows = pack(&seqs, &[0, 1, 2], 1000);
        assert_eq!(
            rows.iter().map(|r| r.len()).collect::<Vec<_>>(),
            vec![900, 500]
        );
        assert_eq!(rows[0].segs.starts(), &[0, 600]);
        // row 599 (last of sequence 0) would label row 600 of sequence 1: not a candidate
        let c = rows[0].anchor_candidates();
        assert!(c.contains(&598) && !c.contains(&599) && c.contains(&600));
        assert_eq!(c.len(), (100..599).len() + (600..899).len());
    }
}

//! Matmul FLOPs of one training row, for MFU: what the drafter's step must compute, counted
//! from the shapes (not from what the kernels happen to execute: masked attention cells and
//! the target's forward are not counted).
//!
//! Per drafter layer, forward, with `R` block rows, `m` context rows, `c` visible attention
//! cells (query row, key) and `2·a·b` FLOPs per `[a] × [a, b]` product row:
//! q `R·h·(nh·d)`, k and v `(R+m)·h·(nkv·d)` each, o `R·(nh·d)·h`, MLP `3·R·h·I`,
//! scores and values `2·nh·d·c`; once per row the context projection `m·(taps·h)·h`; the LM
//! head `T·h·V` for the `T` trained rows. A backward costs twice its forward for trained
//! weights and once for the frozen LM head (input gradient only): total = 3 × drafter forward +
//! 2 × LM head forward.
//!
//! Example (the test): h = 4, nh = 2, nkv = 1, d = 2, I = 8, 1 layer, 2 taps, V = 10; m = 3
//! context rows, one anchor with B = 2 (R = 2, T = 1), c = 5 cells → forward
//! 2·(2·4·4 + 2·5·4·2 + 2·4·4 + 3·2·4·8 + 2·2·2·5 + 3·8·4) = 2·(32 + 80 + 32 + 192 + 40 + 96)
//! = 944, LM head 2·1·4·10 = 80; step = 3·944 + 2·80 = 2,992.

use dflash_core::config::DrafterConfig;
use dflash_core::segments::Segments;
use dflash_core::visibility::{draft_training_parts, DraftRule};

/// The sizes of one training row's drafter step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowShape {
    /// Context rows (the row's tokens).
    pub context_rows: usize,
    /// Block rows: anchors × B.
    pub block_rows: usize,
    /// Rows with a loss (anchors × (B − 1)).
    pub trained_rows: usize,
    /// Visible (query row, key) pairs of one layer's attention.
    pub attention_cells: usize,
}

impl RowShape {
    /// The shape of a row with `segs` and `anchors` under full attention (z-lab's drafter
    /// layers): cells from the one draft rule ([`draft_training_parts`]).
    pub fn of(segs: &Segments, anchors: &[usize], block: usize) -> Self {
        let (ctx, own) = draft_training_parts(DraftRule::FULL, segs, anchors, block);
        let own_cells = own.data.iter().filter(|&&v| v).count();
        Self {
            context_rows: segs.len(),
            block_rows: anchors.len() * block,
            trained_rows: anchors.len() * (block - 1),
            attention_cells: ctx.iter().map(|r| r.len()).sum::<usize>() + own_cells,
        }
    }
}

/// Matmul FLOPs of one optimizer step over one row (see the module doc).
pub fn step_flops(cfg: &DrafterConfig, n_taps: usize, vocab: usize, row: &RowShape) -> f64 {
    let (h, nh, nkv, d, inter) = (
        cfg.hidden_size as f64,
        cfg.num_attention_heads as f64,
        cfg.num_kv_heads() as f64,
        cfg.head_dim() as f64,
        cfg.intermediate_size as f64,
    );
    let (r, m) = (row.block_rows as f64, row.context_rows as f64);
    let layer = 2.0
        * (r * h * nh * d
            + 2.0 * (r + m) * h * nkv * d
            + r * nh * d * h
            + 3.0 * r * h * inter
            + 2.0 * nh * d * row.attention_cells as f64);
    let drafter = cfg.num_hidden_layers as f64 * layer + 2.0 * m * n_taps as f64 * h * h;
    let lm_head = 2.0 * row.trained_rows as f64 * h * vocab as f64;
    3.0 * drafter + 2.0 * lm_head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_example() {
        let cfg: DrafterConfig = serde_json::from_str(
            r#"{"hidden_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 2, "intermediate_size": 8, "num_hidden_layers": 1,
                "vocab_size": 10, "block_size": 2, "num_target_layers": 4}"#,
        )
        .unwrap();
        let row = RowShape {
            context_rows: 3,
            block_rows: 2,
            trained_rows: 1,
            attention_cells: 5,
        };
        assert_eq!(step_flops(&cfg, 2, 10, &row), 2992.0);
    }

    #[test]
    fn cells_follow_the_draft_rule() {
        // anchor 3 of a 6-token sequence, B = 2: both block rows see context 0..3 (3 keys)
        // and the whole block (2 keys): 2 · (3 + 2) = 10 cells
        let s = RowShape::of(&Segments::single(6), &[3], 2);
        assert_eq!(
            s,
            RowShape {
                context_rows: 6,
                block_rows: 2,
                trained_rows: 1,
                attention_cells: 10
            }
        );
    }
}

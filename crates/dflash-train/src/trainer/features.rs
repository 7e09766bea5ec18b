//! The target's context features of training rows, kept on the device across epochs.

use std::collections::HashMap;

use anyhow::Result;

use crate::loss::Features;

/// The target's context features of training rows, kept on the device across epochs up to a
/// byte budget. The target is frozen and deterministic, so a kept row's features are exactly
/// what its forward would give on the next visit: the same function, run once per row instead
/// of once per visit. Rows past the budget are recomputed at every visit. Example: 480 packed
/// rows of ~780 tokens, 5 taps of width 576 in bf16: 480 × 780 × 2,880 × 2 B ≈ 2.2 GB.
pub struct FeatureCache {
    pub(super) budget: usize,
    used: usize,
    pub(super) hits: usize,
    rows: HashMap<usize, Features>,
}

impl FeatureCache {
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget: budget_bytes,
            used: 0,
            hits: 0,
            rows: HashMap::new(),
        }
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The features of row `key`: kept ones, or `compute()` (kept when they fit the budget).
    pub fn get(
        &mut self,
        key: usize,
        compute: impl FnOnce() -> Result<Features>,
    ) -> Result<Features> {
        if let Some(f) = self.rows.get(&key) {
            self.hits += 1;
            return Ok(f.clone());
        }
        let f = compute()?;
        let bytes = f.bytes();
        if self.used + bytes <= self.budget {
            self.used += bytes;
            self.rows.insert(key, f.clone());
        }
        Ok(f)
    }
}

//! The tap convention, written once.
//!
//! **Tap `i` is the output of target decoder layer `i`** (0-based), i.e. the residual stream
//! after layer `i` and before the final norm. In transformers' terms that is
//! `output.hidden_states[i + 1]` (`hidden_states[0]` is the embedding output). Example: SmolLM2
//! has 30 layers; a 5-layer drafter taps `[1, 8, 14, 20, 27]`, which are transformers'
//! `hidden_states[2], [9], [15], [21], [28]`. The drafter's context feature is the
//! concatenation of the taps in this order along the hidden dimension.

/// The transformers `hidden_states` index of tap `i`.
pub const fn hidden_states_index(tap: usize) -> usize {
    tap + 1
}

/// z-lab's default tap ids when a drafter config has none: one draft layer taps the middle
/// layer `N / 2`; otherwise `round(1 + i * (N - 4) / (L - 1))` for `i` in `0..L`, with
/// Python's round (half to even). N = 30 target layers, L = 5 draft layers gives
/// `[1, 8, 14, 20, 27]` (at i = 3, 1 + 3 * 26 / 4 = 20.5 rounds to 20, not 21).
pub fn default_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers <= 1 {
        return vec![num_target_layers / 2];
    }
    let start = 1.0f64;
    let span = num_target_layers as f64 - 3.0 - start;
    (0..num_draft_layers)
        .map(|i| {
            (start + (i as f64 * span) / (num_draft_layers - 1) as f64).round_ties_even() as usize
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zlab_default_uses_python_rounding() {
        assert_eq!(default_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(30, 1), vec![15]);
        assert_eq!(hidden_states_index(27), 28);
    }
}

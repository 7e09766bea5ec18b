//! Which keys a query sees: the one place where every attention mask comes from.
//!
//! The rules live here and nowhere else:
//! - **target (causal)**: a target query at absolute position `p` sees every key at position
//!   `<= p` (cache rows and earlier new rows). Verify of a chain block is this rule.
//! - **draft**: a drafter query in the block anchored at `a` (rows at positions `a .. a+B`)
//!   sees the context keys strictly before the anchor and every key of its own block
//!   (bidirectional). Anchor at 37, B = 16: context rows 0..=36 visible, block rows 37..=52
//!   visible, the context feature at 37 (the anchor's own hidden state) is NOT visible.
//!   Training (many blocks of one sequence, one mask) and inference (one block on top of the
//!   draft KV cache) both build their masks from [`DraftRule::sees`].
//! - **tree**: a tree node sees every committed cache row and its ancestors (itself included),
//!   nothing else; see [`tree`].
//! - **packed**: the target rule applied per sequence when several independent sequences
//!   share one cache row and one forward (packed training sequences); see [`packed`].
//! - **right-aligned**: the target rule for one sequence of a batched cache (batched data
//!   regeneration); see [`right_aligned`].
//!
//! Masks are boolean matrices here; the model turns them into additive masks (0 / -inf).

mod draft;
mod matrix;
mod target;

pub use draft::{
    draft_inference, draft_inference_placed, draft_training, draft_training_parts, DraftKey,
    DraftRule,
};
pub use matrix::{window_sees, Visibility, WINDOW};
pub use target::{
    causal, causal_rows, packed, pad_rows, pad_rows_causal, right_aligned, right_aligned_rows, tree,
};

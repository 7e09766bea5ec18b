//! What a proposer hands the rest of the round: the tree to verify and how the walk judges it.
//! A round on the device is a way of judging (its drafts and the verify's inputs travel with
//! the proposal), not a branch of every stage.

use candle_core::Tensor;
use dflash_core::sampled_tree::SampledTree;
use dflash_core::tree::DraftTree;
use dflash_model::cuda::graphed::Staged;
use dflash_model::models::target::ForwardInputs;
use dflash_model::ops::sample_rows::Uniforms;

/// One round's proposal. Example: a DFlash chain at T = 0 on the host → tree `[x, a, b, c]`,
/// [`Judge::Target`] (the target's arg-max per row decides), `drafted`; an AR step → tree
/// `[x]`, [`Judge::Target`], not drafted.
pub(super) struct Proposal {
    /// The anchor and the drafts below it (a round on the device: placeholders until its
    /// verify reads them back).
    pub(super) tree: DraftTree,
    pub(super) judge: Judge,
    /// Whether the drafter ran (it then took the context features; a round without a draft
    /// adds its rows to them for the next draft).
    pub(super) drafted: bool,
}

impl Proposal {
    /// The anchor alone: an AR step, no draft.
    pub(super) fn anchor_alone(anchor: u32) -> Self {
        Self {
            tree: DraftTree::chain(anchor, &[]),
            judge: Judge::Target,
            drafted: false,
        }
    }

    /// A drafted tree and how it is judged.
    pub(super) fn drafted(tree: DraftTree, judge: Judge) -> Self {
        Self {
            tree,
            judge,
            drafted: true,
        }
    }
}

/// How the walk decides a proposal's drafts.
pub(super) enum Judge {
    /// By the target's own token at every row: its arg-max at T = 0, its draw at T > 0 (the
    /// exact match); a draft is kept while it equals the token of the row before it.
    Target,
    /// A chain drawn from the drafter's distributions: the distribution of each draft, for
    /// the residual rule.
    Chain(Vec<Vec<f32>>),
    /// A tree drawn from the drafter's distributions, with its per-depth distributions.
    Tree(SampledTree),
    /// A tree drawn where the logits are: each depth's draft distribution (`[depths, vocab]`,
    /// there) and the round's uniform numbers (the draws', then the walk's from `from`).
    TreeOnDevice { q: Tensor, u: Uniforms, from: usize },
    /// A chain round kept on the device until its verify, which replaces it by
    /// [`Judge::Read`].
    Device(DeviceRound),
    /// What the verify of a round on the device read back.
    Read(ReadBack),
    /// The target's arg-max token at every row (T = 0), picked for many sequences at once (a
    /// speculative batch's one arg-max of every slot's rows): [`Judge::Target`]'s walk at
    /// T = 0 over tokens already read. E.g. rows [anchor, a, b] picked [a, c, d]: a is kept,
    /// b is not, c is the bonus.
    Picked(Vec<u32>),
}

impl Judge {
    /// The round on the device, when this is one (the judge left as [`Judge::Target`] until
    /// the verify sets what it read back).
    pub(super) fn take_device(&mut self) -> Option<DeviceRound> {
        match std::mem::replace(self, Judge::Target) {
            Judge::Device(round) => Some(round),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// A chain round kept on the device: its drafts (`[n]` u32, the verify's ids) and how the
/// verify's rows decide them.
pub(super) struct DeviceRound {
    pub(super) drafts: Tensor,
    pub(super) judged_by: OnDevice,
    /// The verify's inputs, uploaded before the draft ran (an upload waits for the device's
    /// queue: after the draft, it would wait for the draft).
    pub(super) staged: StagedVerify,
}

/// How a round on the device decides its drafts from the verify's rows.
pub(super) enum OnDevice {
    /// T = 0: the target's arg-max of every row.
    Argmax,
    /// The exact match at T > 0: the target's own draw at every row (`n + 1` uniform numbers,
    /// one per row); the walk keeps a draft while it equals the draw of the row before it.
    Draws(Uniforms),
    /// The residual rule: the drafter's distributions `[n, vocab]` the drafts were drawn
    /// from, with the round's uniform numbers (`3n + 1`: the drafts' draws, then the
    /// verdicts', then the bonuses', then the last row's draw).
    Judge(Tensor, Uniforms),
}

/// A verify's inputs built and uploaded ahead of its forward.
pub(super) enum StagedVerify {
    Graphed(Staged),
    Eager(ForwardInputs),
}

/// What a round on the device read back in its one transfer, `n` drafts first. Example:
/// drafts (a, b, c) → `Tokens([a, b, c, a, b, z, w])` (the target's token of each of the 4
/// rows), or `Verdicts([a, b, c, 1, ·, 1, ·, 0, z, ·])` (kept, kept, rejected with the bonus z;
/// then the last row's draw).
pub(super) enum ReadBack {
    /// The target's token per row: its arg-max (T = 0) or its draw (the exact match).
    Tokens(Vec<u32>),
    /// The residual rule: each draft's verdict and bonus, then the last row's draw.
    Verdicts(Vec<u32>),
}

//! Stages 2–4 of a round: verify the proposal in one target forward, walk it with the target's
//! own samples, commit the accepted path and the bonus.

use dflash_model::ops::argmax::{argmax_rows, argmax_rows_kept};
use dflash_model::ops::sample_rows::{draw_rows, judge_rows, Uniforms};
use dflash_model::ops::sampled_tree::walk_sampled_tree;
use dflash_model::{Rows, TargetOutput};

use super::proposal::{DeviceRound, OnDevice, ReadBack, StagedVerify};
use super::*;

impl Decoding<'_> {
    /// Stage 2, verify: the whole proposal in ONE target forward (the ancestor-only mask); returns
    /// the forward's logits and taps, and the cache length before it. A round on the device
    /// runs its staged forward and leaves what it read back in the proposal's judge.
    pub(super) fn verify(&mut self, p: &mut Proposal) -> Result<(TargetOutput, usize)> {
        let cache_len = self.cache.len();
        if let Some(round) = p.judge.take_device() {
            let (out, read) = self.verify_on_device(round)?;
            p.judge = Judge::Read(read);
            return Ok((out, cache_len));
        }
        let tree = &p.tree;
        let (positions, visibility) = (tree.positions(self.start), tree.visibility(cache_len));
        let out = match self.graphed.as_mut() {
            Some(g) => g.forward(
                self.target,
                &tree.tokens,
                &positions,
                &visibility,
                &mut self.cache,
                &self.taps,
            )?,
            None => self.target.forward(
                &tree.tokens,
                &positions,
                &visibility,
                &mut self.cache,
                &self.taps,
                &Rows::All,
            )?,
        };
        Ok((out, cache_len))
    }

    /// The verify of a round on the device: its staged forward reading the drafts where they
    /// are, then the round's one read of the device (charged to the verify): the drafts and
    /// the target's arg-max of every row (T = 0), or each draft's verdict and bonus and the
    /// last row's draw (T > 0).
    fn verify_on_device(&mut self, round: DeviceRound) -> Result<(TargetOutput, ReadBack)> {
        let DeviceRound {
            drafts,
            judged_by,
            staged,
        } = round;
        let out = match (staged, self.graphed.as_mut()) {
            (StagedVerify::Graphed(s), Some(g)) => {
                g.run(self.target, s, Some(&drafts), &mut self.cache, &self.taps)?
            }
            (StagedVerify::Eager(mut inputs), _) => {
                inputs.set_ids(1, &drafts)?;
                self.target
                    .forward_prepared(&inputs, &mut self.cache, &self.taps, &Rows::All)?
                    .one_sequence()?
            }
            (StagedVerify::Graphed(_), None) => {
                bail!("a staged fixed-shape verify without its forwards")
            }
        };
        let logits = out.logits.as_ref().unwrap();
        let n = drafts.dims1()?;
        let tail = match &judged_by {
            OnDevice::Argmax => argmax_rows_kept(logits)?,
            OnDevice::Draws(u) => draw_rows(&self.probs(logits)?, u, 0)?,
            OnDevice::Judge(q, u) => {
                let p = self.probs(logits)?;
                let verdicts = judge_rows(&p.narrow(0, 0, n)?, q, &drafts, u, n, 2 * n)?;
                let last = draw_rows(&p.narrow(0, n, 1)?, u, 3 * n)?;
                Tensor::cat(&[&verdicts.flatten_all()?, &last], 0)?
            }
        };
        let read = Tensor::cat(&[&drafts, &tail], 0)?.to_vec1::<u32>()?;
        Ok(match judged_by {
            OnDevice::Judge(..) => (out, ReadBack::Verdicts(read)),
            OnDevice::Argmax | OnDevice::Draws(_) => (out, ReadBack::Tokens(read)),
        })
    }

    /// Stage 3, walk: the tree walked with the target's own samples, as its proposal's judge
    /// says: the accepted path (tree rows) and the bonus token.
    pub(super) fn walk(
        &mut self,
        p: &mut Proposal,
        out: &TargetOutput,
    ) -> Result<(Vec<usize>, u32)> {
        let _p = tracing::info_span!(target: "phase", "sample").entered();
        let logits = out.logits.as_ref().unwrap();
        let (tree, judge) = (&mut p.tree, std::mem::replace(&mut p.judge, Judge::Target));
        if let Judge::Read(read) = judge {
            return walk_read(tree, read);
        }
        if tree.len() == 1 && self.samples_on_device() {
            // AR (or a round with no room for drafts) at T > 0: one draw on the device
            let u = Uniforms::new(&self.sampler.uniforms(1), &self.target.device)?;
            let p = self.probs(logits)?;
            return Ok((vec![], draw_rows(&p, &u, 0)?.to_vec1::<u32>()?[0]));
        }
        match judge {
            Judge::Chain(qs) => {
                // a chain's rows are 0 (the anchor), 1 … n (the drafts)
                let (kept, bonus) = self
                    .sampler
                    .walk_chain(&tree.tokens[1..], &qs, |r| row(logits, r))?;
                Ok(((1..=kept).collect(), bonus))
            }
            Judge::Tree(st) => self.sampler.walk_sampled_tree(&st, |r| row(logits, r)),
            Judge::TreeOnDevice { q, u, from } => {
                let params = &self.sampler.params;
                Ok(walk_sampled_tree(logits, params, &q, tree, &u, from)?)
            }
            Judge::Target => self.walk_by_target(tree, logits),
            Judge::Picked(best) => walk_picked(tree, &best),
            // the verify turned a round on the device into what it read back, walked above
            Judge::Device(_) | Judge::Read(_) => bail!("a round on the device walked unverified"),
        }
    }

    /// The walk by the target's own token at every row: its arg-max (T = 0) or its draw (the
    /// exact match), a draft kept while it equals the token of the row before it.
    fn walk_by_target(&mut self, tree: &DraftTree, logits: &Tensor) -> Result<(Vec<usize>, u32)> {
        if self.sampler.params.is_greedy() {
            // T = 0: the target's token of every row, picked on the device (one index per row
            // leaves it, not the rows), by the host's rule
            return walk_picked(tree, &argmax_rows(logits)?);
        }
        if self.samples_on_device() {
            // the exact match drawing on the device (a DDTree of the top-K, a DFlash2 chain):
            // the target's draw at every row there; one index per row leaves it
            // each row with the number of the token it decides ([`Sampler::seek`])
            let depth = tree.depths.iter().max().map_or(0, |d| d + 1);
            let by_depth = self.sampler.uniforms(depth);
            let u: Vec<f32> = tree.depths.iter().map(|&d| by_depth[d]).collect();
            let u = Uniforms::new(&u, &self.target.device)?;
            let drawn = draw_rows(&self.probs(logits)?, &u, 0)?.to_vec1::<u32>()?;
            return tree.walk(|r| Ok::<u32, anyhow::Error>(drawn[r]));
        }
        let sampler = &mut self.sampler;
        tree.walk(|r| Ok::<u32, anyhow::Error>(sampler.sample(&row(logits, r)?)))
    }

    /// Stage 4, commit: the path and the bonus, cut at `max_new_tokens`, at the first stop token
    /// and at the end of the first repeated window ([`Request::loop_window`]);
    /// keep the committed rows' K/V and taps (the bonus is the next anchor). Returns how many
    /// tokens the round committed (τ_round).
    pub(super) fn commit(
        &mut self,
        p: &Proposal,
        path: &[usize],
        bonus: u32,
        out: &TargetOutput,
        cache_len: usize,
    ) -> Result<usize> {
        let kept = self.commit_tokens(p, path, bonus);
        compact_cache(&mut self.cache, cache_len, &kept)?;
        self.commit_context(p, out, &kept)?;
        Ok(kept.len())
    }

    /// [`Decoding::commit`]'s tokens: the committed ones appended, the anchor moved past them,
    /// the sampler's stream sought. Returns the verify rows whose K/V stay (the anchor and the
    /// committed path before the next anchor); as many as the tokens committed. Example: path
    /// [1, 2] and a bonus, nothing cut → rows [0, 1, 2], 3 tokens.
    pub(super) fn commit_tokens(&mut self, p: &Proposal, path: &[usize], bonus: u32) -> Vec<usize> {
        let max_len = self.req.prompt_ids.len() + self.req.max_new_tokens;
        let mut produced_tokens: Vec<u32> = path.iter().map(|&r| p.tree.tokens[r]).collect();
        produced_tokens.push(bonus);
        let mut produced = produced_tokens.len().min(max_len - self.start - 1);
        for (i, t) in produced_tokens[..produced].iter().enumerate() {
            let looped = self.loops.push(*t);
            if looped || self.req.stop_ids.contains(t) {
                produced = i + 1;
                self.stopped = true;
                self.looped = looped && !self.req.stop_ids.contains(t);
                break;
            }
        }
        self.new_tokens
            .extend_from_slice(&produced_tokens[..produced]);
        self.start += produced;
        if !self.sampler.params.is_greedy() && !self.samples_drafts() {
            // the exact match drew each row with its token's number: the next round's first
            // token draws the number after the committed ones
            self.sampler.seek(self.new_tokens.len());
        }
        std::iter::once(0)
            .chain(path.iter().copied())
            .take(produced)
            .collect()
    }

    /// [`Decoding::commit`]'s context: the taps of the `kept` verify rows become the drafter's
    /// next context features (a round without a draft adds them to those not seen yet).
    fn commit_context(&mut self, p: &Proposal, out: &TargetOutput, kept: &[usize]) -> Result<()> {
        if self.drafting.is_some() {
            let idx = Tensor::new(
                kept.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                &self.target.device,
            )?;
            let new = Target::concat_taps(&out.taps)?.index_select(&idx, 0)?;
            self.append_context(p, new.unsqueeze(0)?)?;
        }
        Ok(())
    }

    /// The drafter's next context rows: after a drafted round, the committed rows `new`
    /// (`[1, kept, taps · hidden]`) alone (the drafter's cache holds what it drafted from);
    /// after an AR round, appended to the rows it has not seen yet. E.g. context [c1], an AR
    /// round commits t → [c1, t]; a drafted round commits a, b → [a, b].
    pub(in crate::decode) fn append_context(&mut self, p: &Proposal, new: Tensor) -> Result<()> {
        if let Some(dr) = self.drafting.as_mut() {
            dr.ctx = match p.drafted {
                false => Tensor::cat(&[&dr.ctx, &new], 1)?,
                true => new,
            };
        }
        Ok(())
    }
}

/// The walk by the target's arg-max token of every row, `best` (T = 0): a draft is kept while
/// it equals the token of the row before it. Example: chain [anchor, a, b], best [a, c, d] →
/// path [1], bonus c.
fn walk_picked(tree: &DraftTree, best: &[u32]) -> Result<(Vec<usize>, u32)> {
    tree.walk(|r| Ok::<u32, anyhow::Error>(best[r]))
}

/// The walk of a round on the device from what its verify read back: the drafts go into the
/// tree's placeholders; then the target's token per row decides them, or (the residual rule)
/// the first rejected draft ends the round with its bonus, else the last row's draw is the
/// bonus. Example: drafts (a, b, c), verdicts kept, kept, rejected with z → path [1, 2], z.
fn walk_read(tree: &mut DraftTree, read: ReadBack) -> Result<(Vec<usize>, u32)> {
    let n = tree.len() - 1;
    match read {
        ReadBack::Tokens(read) => {
            tree.tokens[1..].copy_from_slice(&read[..n]);
            // the target's token of every row: its arg-max, or its draw (the exact match)
            tree.walk(|r| Ok::<u32, anyhow::Error>(read[n + r]))
        }
        ReadBack::Verdicts(read) => {
            tree.tokens[1..].copy_from_slice(&read[..n]);
            let verdicts = &read[n..3 * n];
            Ok(match verdicts.chunks(2).position(|v| v[0] == 0) {
                Some(k) => ((1..=k).collect(), verdicts[2 * k + 1]),
                None => ((1..=n).collect(), read[3 * n]),
            })
        }
    }
}

//! The timed forwards of `bench shape`: the random pair with its caches filled, then the AR
//! step, the chain verify, the draft block (eager and replayed from a CUDA graph), the DDTree
//! verifies and each forward's GPU costs.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_core::config::TargetConfig;
use dflash_core::tree::DraftTree;
use dflash_model::cuda::graphed_draft::GraphedDraft;
use dflash_model::io::weights::TensorStore;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::{KvCache, Rows, Target};

use super::graph_costs::{graph_costs, GraphCosts};
use super::model::{bench_tokens, random_target};
use super::BenchShapeArgs;
use crate::timing::{copy_bandwidth, read_bandwidth, time};

/// The random target and drafter every timing runs, after the `n` context rows.
pub(super) struct Bench {
    pub target: Target,
    pub drafter: Drafter,
    pub taps: Vec<usize>,
    /// Committed rows in the target's cache (`--cache`).
    pub n: usize,
    /// The draft block's rows (`--block-size`).
    pub block: usize,
    pub vocab: u32,
    /// The context features' last row: the timed draft blocks' input.
    pub last_row: Tensor,
}

/// The caches the timings run on: the target's holds the `n` context rows, the drafter's the
/// context before the last row. Every timed run rolls them back.
pub(super) struct Caches {
    pub target: KvCache,
    pub draft: KvCache,
}

/// The eager timings, median seconds: the AR step, the chain verify (arg-max per row, then
/// every row's logits to the host) and the draft block per read.
pub(super) struct Eager {
    pub ar: f64,
    pub chain: f64,
    pub chain_rows: f64,
    pub draft: f64,
    pub draft_top: f64,
    pub draft_rows: f64,
}

/// The draft block replayed from a CUDA graph: arg-max and top-32 read times (median
/// seconds), and the max abs Δ of its logits against the eager draft's.
pub(super) type DraftGraph = (f64, f64, f32);

/// `(budget, rows, median seconds)` of each DDTree verify.
pub(super) type TreeTime = (usize, usize, f64);

/// A best-first tree of `budget` nodes over `depth` positions from fixed, decaying scores
/// (the shape of a confident drafter's tree: deep along rank 0, bushy near the root).
fn synthetic_tree(budget: usize, depth: usize, vocab: u32) -> DraftTree {
    let top: Vec<Vec<(u32, f32)>> = (0..depth)
        .map(|d| {
            (0..budget.min(vocab as usize))
                .map(|r| {
                    (
                        (1000 + 7 * r as u32 + d as u32) % vocab,
                        -0.3 - 1.2 * r as f32,
                    )
                })
                .collect()
        })
        .collect();
    DraftTree::build(1, &top, budget)
}

impl Bench {
    /// The random pair of `a`'s shape (target seed 0, drafter seed 1), the target's cache
    /// filled with `--cache` context tokens and the drafter's with the context before the last
    /// row (one draft block anchored there).
    pub fn build(
        a: &BenchShapeArgs,
        cfg: &TargetConfig,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Self, Caches)> {
        let (target, dcfg) = random_target(
            &a.model.shape,
            cfg,
            dtype,
            dev,
            a.draft_layers,
            a.block_size,
        )?;
        let drafter = Drafter::load(dcfg, &TensorStore::random(dtype, dev, 1)?, &target)?;
        let vocab = target.vocab_size() as u32;
        let n = a.cache;
        let ctx = bench_tokens(n, vocab as usize);
        let taps = drafter.target_layer_ids.clone();
        let mut cache = target.new_cache();
        let out = target.forward_causal(&ctx, &mut cache, &taps, &Rows::None)?;
        let ctx_feats = Target::concat_taps(&out.taps)?.unsqueeze(0)?;
        // the drafter's cache holds the context before the last row
        let mut dcache = drafter.new_cache();
        drafter.draft(
            &target,
            None,
            &mut dcache,
            &ctx_feats.narrow(1, 0, n - 1)?,
            BlockAt {
                token: 5,
                anchor: n - 1,
                block: a.block_size,
                positions: a.block_size - 1,
            },
        )?;
        let last_row = ctx_feats.narrow(1, n - 1, 1)?;
        let bench = Bench {
            target,
            drafter,
            taps,
            n,
            block: a.block_size,
            vocab,
            last_row,
        };
        let caches = Caches {
            target: cache,
            draft: dcache,
        };
        Ok((bench, caches))
    }

    /// The timed draft blocks' place: anchor `n`, after the `n - 1` cached context rows.
    fn block_at(&self) -> BlockAt {
        BlockAt {
            token: 5,
            anchor: self.n,
            block: self.block,
            positions: self.block - 1,
        }
    }

    /// The chain verify of the block's rows.
    pub fn chain(&self) -> DraftTree {
        DraftTree::chain(1, &vec![2u32; self.block - 1])
    }

    /// `tree`'s forward on the cache's `n` rows, reading back what the loop reads: at T = 0
    /// one arg-max per row (picked on the device), at T > 0 (`rows`) the logits of every row.
    /// The cache is rolled back to `n` rows.
    fn forward(&self, cache: &mut KvCache, tree: &DraftTree, rows: bool) -> Result<()> {
        let n = self.n;
        let o = self.target.forward(
            &tree.tokens,
            &tree.positions(n),
            &tree.visibility(n),
            cache,
            &self.taps,
            &Rows::All,
        )?;
        let logits = o.logits.context("the forward returned no logits")?;
        if rows {
            let _ = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        } else {
            let _ = dflash_model::ops::argmax::argmax_rows(&logits)?;
        }
        cache.truncate(n)?;
        Ok(())
    }

    /// A draft block and what the round reads from it: 0 the chain's argmax per row, 1
    /// DDTree-32's candidates picked on the device, 2 every row's log-probabilities to the host.
    fn draft(&self, dcache: &mut KvCache, read: u8) -> Result<()> {
        dcache.truncate(self.n - 1)?;
        let l = self
            .drafter
            .draft(&self.target, None, dcache, &self.last_row, self.block_at())?;
        match read {
            0 => drop(Drafter::argmax_rows(&l)?),
            1 => drop(dflash_model::ops::top_k::top_k_rows(
                &Drafter::log_probs(&l)?,
                32,
            )?),
            _ => drop(Drafter::log_probs(&l)?.to_vec2::<f32>()?),
        }
        Ok(())
    }

    /// The eager forwards, `repeats` runs each. With DFLASH_PROFILE set: the time per phase of
    /// the AR steps and of the chain verifies (the device synchronised at every phase edge: for
    /// attribution, the times measured are not).
    pub fn time_eager(&self, c: &mut Caches, dev: &Device, repeats: usize) -> Result<Eager> {
        let verify = |cache: &mut KvCache, tree: &DraftTree| self.forward(cache, tree, false);
        let _ = dflash_model::profile::report();
        let ar = time(dev, repeats, || {
            verify(&mut c.target, &DraftTree::chain(1, &[]))
        })?;
        dflash_model::profile::print_report("AR step");
        let chain = self.chain();
        let t_chain = time(dev, repeats, || verify(&mut c.target, &chain))?;
        dflash_model::profile::print_report("chain verify");
        let chain_rows = time(dev, repeats, || self.forward(&mut c.target, &chain, true))?;
        let draft = time(dev, repeats, || self.draft(&mut c.draft, 0))?;
        let draft_top = time(dev, repeats, || self.draft(&mut c.draft, 1))?;
        let draft_rows = time(dev, repeats, || self.draft(&mut c.draft, 2))?;
        Ok(Eager {
            ar,
            chain: t_chain,
            chain_rows,
            draft,
            draft_top,
            draft_rows,
        })
    }

    /// The same block replayed from one CUDA graph (GPU only; `GraphedDraft`, as decoding with
    /// --cuda-graphs runs it): the argmax and top-32 reads, and the replay's logits against the
    /// eager draft's.
    pub fn time_draft_graph(
        &self,
        c: &mut Caches,
        dev: &Device,
        repeats: usize,
    ) -> Result<DraftGraph> {
        let (n, block, at) = (self.n, self.block, self.block_at());
        let (drafter, target, last_row) = (&self.drafter, &self.target, &self.last_row);
        let mut gcache = c.draft.clone();
        gcache.truncate(n - 1)?;
        let mut g = GraphedDraft::new(&mut gcache, n + 2 * block, block)?;
        let mut gdraft = |read: u8| -> Result<Option<Tensor>> {
            gcache.truncate(n - 1)?;
            let (_, l) = g.draft_rows(drafter, target, None, &mut gcache, last_row, at)?;
            Ok(match read {
                0 => {
                    drop(Drafter::argmax_rows(&l)?);
                    None
                }
                1 => {
                    drop(dflash_model::ops::top_k::top_k_rows(
                        &Drafter::log_probs(&l)?,
                        32,
                    )?);
                    None
                }
                _ => Some(l.copy()?),
            })
        };
        gdraft(0)?; // captures
        let replayed = gdraft(2)?.context("the replayed draft's logits")?;
        c.draft.truncate(n - 1)?;
        let eager = drafter.draft(target, None, &mut c.draft, last_row, at)?;
        let diff = (replayed - eager)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let t = time(dev, repeats, || gdraft(0).map(drop))?;
        let t_top = time(dev, repeats, || gdraft(1).map(drop))?;
        Ok((t, t_top, diff))
    }

    /// The DDTree verify of each budget's synthetic tree.
    pub fn time_trees(
        &self,
        cache: &mut KvCache,
        budgets: &[usize],
        dev: &Device,
        repeats: usize,
    ) -> Result<Vec<TreeTime>> {
        let mut tree_rows = Vec::new();
        for &b in budgets {
            let tree = synthetic_tree(b, self.block - 1, self.vocab);
            let t = time(dev, repeats, || self.forward(cache, &tree, false))?;
            tree_rows.push((b, tree.len(), t));
        }
        Ok(tree_rows)
    }

    /// The same forwards' device work, eager and as one CUDA graph (GPU only): the AR step, the
    /// chain verify and each budget's DDTree verify, with their names and rows.
    pub fn graph_costs(
        &self,
        cache: &mut KvCache,
        budgets: &[usize],
        dev: &Device,
        repeats: usize,
    ) -> Result<Vec<(String, usize, GraphCosts)>> {
        let mut g = Vec::new();
        let mut forwards = vec![
            ("AR step".to_string(), DraftTree::chain(1, &[])),
            (format!("chain verify (B = {})", self.block), self.chain()),
        ];
        for &b in budgets {
            forwards.push((
                format!("DDTree-{b} verify"),
                synthetic_tree(b, self.block - 1, self.vocab),
            ));
        }
        for (name, tree) in forwards {
            g.push((
                name,
                tree.len(),
                graph_costs(&self.target, dev, cache, &tree, self.n, &self.taps, repeats)?,
            ));
        }
        Ok(g)
    }
}

/// The memory floor of one forward: its weight bytes at the measured read bandwidth (the
/// copy's beside it).
pub(super) struct Floor {
    /// Parameters one forward reads ([`TargetConfig::forward_weight_params`]).
    pub params: usize,
    /// Bytes/s: read, and a copy's (read + write).
    pub read_bw: f64,
    pub copy_bw: f64,
    /// Seconds per forward.
    pub seconds: f64,
}

impl Floor {
    pub fn measure(cfg: &TargetConfig, dtype: DType, dev: &Device) -> Result<Self> {
        let read_bw = read_bandwidth(dev)?;
        let copy_bw = copy_bandwidth(dev)?;
        let params = cfg.forward_weight_params();
        let seconds = params as f64 * dtype.size_in_bytes() as f64 / read_bw;
        Ok(Floor {
            params,
            read_bw,
            copy_bw,
            seconds,
        })
    }
}

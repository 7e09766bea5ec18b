//! `--profile-replays` and `--profile-eager`: the draft block, the AR step and the chain verify
//! run inside a profiler's range, replayed from CUDA graphs or eagerly, nothing else launched.

use anyhow::Result;
use dflash_core::tree::DraftTree;
use dflash_model::models::drafter::{BlockAt, Drafter};
use dflash_model::{Rows, Target};

/// `--profile-replays`: the draft block (its fixed-shape forward, as decoding replays it), the
/// AR step and the chain verify captured as CUDA graphs, then each replayed `reps` times in
/// that order, nothing launched between them: a kernel profiler's last `reps · (draft + AR +
/// chain)` kernels are these replays, in that order.
pub(super) fn profile_replays(
    target: &Target,
    drafter: &Drafter,
    (cache, dcache): (&mut dflash_model::KvCache, &mut dflash_model::KvCache),
    last_row: &candle_core::Tensor,
    taps: &[usize],
    block: usize,
    reps: usize,
) -> Result<()> {
    use dflash_model::cuda::launch_profile::warm_capture;
    let dev = target.device.clone();
    let n = cache.len();
    // the draft block: anchor n after n - 1 cached context rows, as the timed drafts
    let cap = n + 2 * block;
    dcache.truncate(n - 1)?;
    dcache.reserve_exact(cap)?;
    let at = BlockAt {
        token: 5,
        anchor: n,
        block,
        positions: block - 1,
    };
    let inputs = drafter.prepare_fixed(target, last_row, at, n - 1, block, cap)?;
    let (draft, _) = warm_capture(&dev, dcache, n - 1, |c| {
        drafter.forward_fixed(target, None, &inputs, c)
    })?;
    let mut verifies = Vec::new();
    for inputs in ar_and_chain_inputs(target, n, block)? {
        let (graph, _) = warm_capture(&dev, cache, n, |c| {
            target.forward_prepared(&inputs, c, taps, &Rows::All)
        })?;
        cache.truncate(n)?;
        verifies.push(graph);
    }
    dev.synchronize()?;
    println!(
        "profile replays ({reps} each, in this order): draft block {} kernels, AR step {} kernels, chain verify (B = {block}) {} kernels",
        draft.nodes.kernels, verifies[0].nodes.kernels, verifies[1].nodes.kernels
    );
    // only the replays inside the profiler's range (`ncu --profile-from-start off`)
    dflash_model::cuda::launch_profile::profiled_range(&dev, || {
        for g in [&draft, &verifies[0], &verifies[1]] {
            for _ in 0..reps {
                g.replay()?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}

/// The two forwards the profiling runs replay, prepared on a cache of `n` rows: an AR step
/// and a chain verify of `block` rows, in that order.
fn ar_and_chain_inputs(
    target: &Target,
    n: usize,
    block: usize,
) -> Result<Vec<dflash_model::ForwardInputs>> {
    [
        DraftTree::chain(1, &[]),
        DraftTree::chain(1, &vec![2u32; block - 1]),
    ]
    .iter()
    .map(|t| {
        let vis = t.visibility(n);
        target.prepare(
            &t.tokens,
            &t.positions(n),
            std::slice::from_ref(&vis),
            n,
            None,
        )
    })
    .collect()
}

/// `--profile-eager`: the AR step and the chain verify of `block` rows on the cache's `n` rows,
/// their inputs prepared once (`Target::prepare`: the host's uploads stay outside the counted
/// work, as in [`graph_costs`](super::graph_costs::graph_costs)), run eagerly with candle's
/// param cache warm (so that they upload nothing and launch exactly the kernels a capture of
/// them counts), then each `reps` times in that order inside the profiler range, the cache
/// rolled back to `n` rows after every run.
pub(super) fn profile_eager(
    target: &Target,
    cache: &mut dflash_model::KvCache,
    taps: &[usize],
    block: usize,
    reps: usize,
) -> Result<()> {
    use dflash_model::cuda::launch_profile::{count_launches, profiled_range, ParamCache};
    let dev = target.device.clone();
    let n = cache.len();
    let inputs = ar_and_chain_inputs(target, n, block)?;
    let run = |cache: &mut dflash_model::KvCache, inputs| {
        let o = target.forward_prepared(inputs, cache, taps, &Rows::All)?;
        cache.truncate(n)?;
        anyhow::Ok(o)
    };
    let _params = ParamCache::enable(&dev);
    let mut kernels = Vec::new();
    for i in &inputs {
        run(cache, i)?; // warms the param cache
        kernels.push(count_launches(&dev, || run(cache, i))?.kernels);
    }
    dev.synchronize()?;
    println!(
        "profile replays ({reps} each, in this order): AR step {} kernels, chain verify (B = {block}) {} kernels",
        kernels[0], kernels[1]
    );
    profiled_range(&dev, || {
        for i in &inputs {
            for _ in 0..reps {
                run(cache, i)?;
            }
            dev.synchronize()?;
        }
        Ok(())
    })
}

//! Where one forward's time goes on the GPU: host part, eager device part with and without
//! candle's param cache, kernels and uploads, host enqueue against GPU time, graph replay.

use anyhow::{Context, Result};
use candle_core::DType;
use dflash_core::tree::DraftTree;
use dflash_model::{Rows, Target};

use crate::timing::time;

/// Where one forward's time goes on the GPU ([`dflash_model::cuda::launch_profile`]).
pub(super) struct GraphCosts {
    /// Nodes of the captured forward, without and with candle's param cache.
    pub nodes: dflash_model::cuda::launch_profile::NodeCounts,
    pub nodes_cached: dflash_model::cuda::launch_profile::NodeCounts,
    /// Median seconds: the host part (`prepare`); the device part eager (synchronised), without
    /// and with the param cache; behind a blocker, the host's enqueue and the GPU's time
    /// (`None`: the host waited on the GPU); one replay of the captured graph.
    pub prepare: f64,
    pub eager: f64,
    pub eager_cached: f64,
    pub split: Option<(f64, f64)>,
    pub replay: f64,
    /// Max |Δ| between the logits of a graph replay and of the eager forward.
    pub max_diff: f32,
}

/// Profile `tree`'s forward on a cache of `n` committed rows (rolled back to `n` rows after
/// every run, so each run writes the same rows): its host part, its device part eager, its
/// kernels and uploads (a capture that is never launched), the host's and the GPU's time for
/// the same kernels, and the device part captured into a CUDA graph and replayed.
pub(super) fn graph_costs(
    target: &Target,
    dev: &candle_core::Device,
    cache: &mut dflash_model::KvCache,
    tree: &DraftTree,
    n: usize,
    taps: &[usize],
    repeats: usize,
) -> Result<GraphCosts> {
    use dflash_model::cuda::launch_profile::{capture, count_launches, host_gpu_split, ParamCache};
    let (pos, vis) = (tree.positions(n), tree.visibility(n));
    let prepare = time(dev, repeats, || {
        target.prepare(&tree.tokens, &pos, std::slice::from_ref(&vis), n, None)?;
        Ok(())
    })?;
    let inputs = target.prepare(&tree.tokens, &pos, std::slice::from_ref(&vis), n, None)?;
    let logits = |o: dflash_model::TargetOutput| -> Result<Vec<f32>> {
        Ok(o.logits
            .context("the forward returned no logits")?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let run = |cache: &mut dflash_model::KvCache| -> Result<dflash_model::TargetOutput> {
        let o = target.forward_prepared(&inputs, cache, taps, &Rows::All)?;
        cache.truncate(n)?;
        Ok(o)
    };
    let eager_logits = logits(run(cache)?)?;
    let eager = time(dev, repeats, || run(cache).map(drop))?;
    let nodes = count_launches(dev, || run(cache))?;
    let _param_cache = ParamCache::enable(dev);
    run(cache)?; // warm the param cache
    let eager_cached = time(dev, repeats, || run(cache).map(drop))?;
    let nodes_cached = count_launches(dev, || run(cache))?;
    let mut splits = Vec::new();
    for _ in 0..repeats {
        match host_gpu_split(dev, 3.0 * eager + 0.01, || run(cache)) {
            Ok((s, _)) => splits.push((s.host, s.gpu)),
            Err(e) => {
                eprintln!("host/GPU split: {e:#}");
                break;
            }
        }
    }
    let split = (splits.len() == repeats).then(|| {
        (
            crate::timing::median(splits.iter().map(|s| s.0).collect()),
            crate::timing::median(splits.iter().map(|s| s.1).collect()),
        )
    });
    let (graph, out) = capture(dev, || run(cache))?;
    let replay = time(dev, repeats, || graph.replay())?;
    let graph_logits = logits(out)?;
    let max_diff = eager_logits
        .iter()
        .zip(&graph_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    Ok(GraphCosts {
        nodes,
        nodes_cached,
        prepare,
        eager,
        eager_cached,
        split,
        replay,
        max_diff,
    })
}

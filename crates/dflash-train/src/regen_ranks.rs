//! Data regeneration on several GPUs (`data generate --gpus N`): each rank regenerates its own
//! shards into its own stream, and the launcher merges the streams' manifests into one.
//!
//! The shards of the whole prompt set are dealt round-robin: rank r of N takes global shards
//! r, r + N, r + 2N, … (shard s = prompts s·S .. (s + 1)·S for S prompts per shard) and writes
//! them as its own shards 0, 1, 2, … under `ranks/rank-r/` with its own manifest, so each rank
//! resumes as a single run does. Every prompt's sampler is seeded by its index in the whole set,
//! so the merged data are the data one process writes. The merged `manifest.json` lists the
//! shards in global order up to the first one not written yet (a rank stopped by its time
//! limit); `ranks/partition.json` records N and S, and a directory is continued only with them.
//! Example: 10 prompts, S = 2, N = 2 → rank 0 takes prompts 0, 1, 4, 5, 8, 9 (global shards 0,
//! 2, 4), rank 1 prompts 2, 3, 6, 7 (shards 1, 3); merged: rank-0/shard 0, rank-1/shard 0,
//! rank-0/shard 1, rank-1/shard 1, rank-0/shard 2.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use dflash_model::io::atomic::write_file;
use dflash_model::io::loader::LoadedTarget;
use serde::{Deserialize, Serialize};

use crate::data::{read_manifest, write_manifest, Manifest, ShardInfo};
use crate::prompts::Prompt;
use crate::regen::{regenerate_indexed, RegenOptions};

/// How a directory's prompts are dealt to ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub world: usize,
    pub prompts_per_shard: usize,
}

fn partition_path(out: &Path) -> PathBuf {
    out.join("ranks").join("partition.json")
}

/// Where rank `r` writes its stream.
pub fn rank_dir(out: &Path, rank: usize) -> PathBuf {
    out.join("ranks").join(format!("rank-{rank}"))
}

/// A single-process run refuses a directory written by ranks (and the reverse is refused by
/// [`start`]).
pub(crate) fn refuse_partitioned(out: &Path) -> Result<()> {
    if let Ok(text) = std::fs::read_to_string(partition_path(out)) {
        let p: Partition = serde_json::from_str(&text)?;
        bail!(
            "{} was written by `data generate --gpus {}`: continue it with --gpus {}",
            out.display(),
            p.world,
            p.world
        );
    }
    Ok(())
}

/// The launcher, before starting the ranks: record the partition of a new directory, or check
/// that a continued one was dealt the same way.
pub fn start(out: &Path, p: Partition) -> Result<()> {
    match std::fs::read_to_string(partition_path(out)) {
        Ok(text) => {
            let was: Partition = serde_json::from_str(&text)
                .with_context(|| format!("{}", partition_path(out).display()))?;
            if was != p {
                bail!(
                    "{} was dealt to {} ranks with --shard-size {}: continue it with --gpus {} and --shard-size {}, or use a new --out",
                    out.display(),
                    was.world,
                    was.prompts_per_shard,
                    was.world,
                    was.prompts_per_shard
                );
            }
            Ok(())
        }
        Err(_) => {
            if out.join("manifest.json").exists() {
                bail!(
                    "{} holds a run of one process: continue it without --gpus, or use a new --out",
                    out.display()
                );
            }
            std::fs::create_dir_all(out.join("ranks"))?;
            write_file(&partition_path(out), serde_json::to_string(&p)?.as_bytes())
        }
    }
}

/// Rank `rank`'s prompts, in its own order, with each one's index in the whole set.
pub fn rank_prompts(prompts: &[Prompt], p: Partition, rank: usize) -> (Vec<Prompt>, Vec<usize>) {
    let s = p.prompts_per_shard;
    let index: Vec<usize> = (0..prompts.len().div_ceil(s))
        .filter(|shard| shard % p.world == rank)
        .flat_map(|shard| shard * s..((shard + 1) * s).min(prompts.len()))
        .collect();
    (index.iter().map(|&i| prompts[i].clone()).collect(), index)
}

/// Rank `rank` of the partition recorded in `out` regenerates its shards (resumable).
pub fn regenerate_rank(
    lt: &LoadedTarget,
    prompts: &[Prompt],
    out: &Path,
    opts: &RegenOptions,
    rank: usize,
) -> Result<Manifest> {
    let text = std::fs::read_to_string(partition_path(out))
        .with_context(|| format!("{}: no partition (the launcher writes it)", out.display()))?;
    let p: Partition = serde_json::from_str(&text)?;
    if rank >= p.world || p.prompts_per_shard != opts.prompts_per_shard {
        bail!(
            "rank {rank} with --shard-size {} does not fit the partition of {} ({} ranks, shard size {})",
            opts.prompts_per_shard,
            out.display(),
            p.world,
            p.prompts_per_shard
        );
    }
    let (mine, index) = rank_prompts(prompts, p, rank);
    regenerate_indexed(lt, &mine, &rank_dir(out, rank), opts, &|i| index[i])
}

/// The launcher, after the ranks: one manifest over every rank's shards in global order, up to
/// the first global shard not written yet.
pub fn merge(out: &Path) -> Result<Manifest> {
    let text = std::fs::read_to_string(partition_path(out))
        .with_context(|| format!("{}: no partition to merge", out.display()))?;
    let p: Partition = serde_json::from_str(&text)?;
    // a rank that wrote no shard yet has no manifest: it counts as none written
    let ranks: Vec<Option<Manifest>> = (0..p.world)
        .map(|r| read_manifest(&rank_dir(out, r)).ok())
        .collect();
    let Some(mut merged) = ranks.iter().flatten().next().cloned() else {
        bail!("{}: no rank has written a shard yet", out.display());
    };
    merged.shards.clear();
    for shard in 0.. {
        let (r, local) = (shard % p.world, shard / p.world);
        let Some(info) = ranks[r].as_ref().and_then(|m| m.shards.get(local)) else {
            break;
        };
        merged.shards.push(ShardInfo {
            file: format!("ranks/rank-{r}/{}", info.file),
            ..info.clone()
        });
    }
    write_manifest(out, &merged)?;
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module's example.
    #[test]
    fn shards_are_dealt_round_robin() {
        let prompts: Vec<Prompt> = (0..10)
            .map(|i| crate::prompts::user(format!("p{i}")))
            .collect();
        let p = Partition {
            world: 2,
            prompts_per_shard: 2,
        };
        assert_eq!(rank_prompts(&prompts, p, 0).1, vec![0, 1, 4, 5, 8, 9]);
        assert_eq!(rank_prompts(&prompts, p, 1).1, vec![2, 3, 6, 7]);
        assert_eq!(rank_prompts(&prompts, p, 1).0[2], prompts[6]);
    }
}

//! Checkpoints: the drafter alone in z-lab format (loadable by `generate --drafter` and by
//! `DFlashDraftModel.from_pretrained`) plus `training.json`, and the trainer state beside it.
//!
//! ```text
//! OUT/train_config.json
//! OUT/metrics.jsonl
//! OUT/checkpoints/step-000200/drafter/{config.json, model.safetensors, training.json}
//! OUT/checkpoints/step-000200/trainer/{state.json, moments.safetensors}
//! OUT/checkpoints/step-000200/checksums.json   sha256 of each file above
//! OUT/latest                      "step-000200"
//! OUT/best/{config.json, model.safetensors, training.json}   lowest validation loss
//! ```
//! Every directory is built under a temporary name and put in place atomically, `latest` is
//! replaced atomically after its checkpoint exists ([`dflash_model::io::atomic`]): a kill at
//! any moment leaves the previous checkpoint, `best/` and `latest` whole. A write that fails
//! (a full disk) fails the run with the file named, and leaves them whole too. A checkpoint
//! whose bytes changed after writing is refused by name when a run resumes from it
//! ([`verify_checksums`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_core::config::DrafterConfig;
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::fingerprint::Fingerprint;
use dflash_model::io::atomic::write_file;
use dflash_model::models::drafter_init::write_drafter_into;

/// Written beside the drafter weights: how it was trained and for which target.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingRecord {
    pub train_config: TrainConfig,
    pub loss: crate::config::LossKind,
    pub mask_token_id: u32,
    pub data_target_hash: String,
    pub data_source: String,
    pub data_manifest_sha256: String,
    pub steps: usize,
    pub train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// Per-position acceptance and simulated chain τ on the validation sequences.
    pub val_acceptance: Vec<f64>,
    pub val_simulated_tau: Option<f64>,
    pub fingerprint: Fingerprint,
}

/// The trainer's own state: enough to continue exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub steps_done: usize,
    pub epoch: usize,
    /// Next position in this epoch's permutation of the training sequences.
    pub position: usize,
    pub adam_step: usize,
    pub best_val_loss: Option<f64>,
}

pub fn step_name(step: usize) -> String {
    format!("step-{step:06}")
}

/// Write the drafter files (config.json, model.safetensors as f32, training.json) into `dir`
/// (a directory that `dflash_model::io::atomic::replace_dir` then puts in place).
pub fn write_drafter_files(
    dir: &Path,
    cfg: &DrafterConfig,
    weights: &HashMap<String, Tensor>,
    rec: &TrainingRecord,
) -> Result<()> {
    let cpu: HashMap<String, Tensor> = weights
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    write_drafter_into(dir, cfg, &cpu)?;
    std::fs::write(
        dir.join("training.json"),
        serde_json::to_string_pretty(rec)? + "\n",
    )?;
    Ok(())
}

pub struct CheckpointPaths {
    pub out: PathBuf,
}

impl CheckpointPaths {
    pub fn step_dir(&self, step: usize) -> PathBuf {
        self.out.join("checkpoints").join(step_name(step))
    }
    /// The checkpoint `latest` names, its files checked against their checksums.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let Ok(s) = std::fs::read_to_string(self.out.join("latest")) else {
            return Ok(None);
        };
        let dir = self.out.join("checkpoints").join(s.trim());
        if !dir.is_dir() {
            anyhow::bail!(
                "{} names {}, which is missing: set it to an existing checkpoint's name",
                self.out.join("latest").display(),
                dir.display()
            );
        }
        verify_checksums(&dir)?;
        Ok(Some(dir))
    }
    pub fn set_latest(&self, step: usize) -> Result<()> {
        write_file(&self.out.join("latest"), step_name(step).as_bytes())
    }
    /// Remove all but the newest `keep` step directories.
    pub fn prune(&self, keep: usize) -> Result<()> {
        let dir = self.out.join("checkpoints");
        let mut steps: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
            })
            .collect();
        steps.sort();
        let n = steps.len();
        for p in steps.into_iter().take(n.saturating_sub(keep.max(1))) {
            std::fs::remove_dir_all(&p)?;
        }
        Ok(())
    }
}

/// Save the optimizer moments and the trainer state into `dir`.
pub fn write_trainer_state(
    dir: &Path,
    names: &[String],
    m: &[Tensor],
    v: &[Tensor],
    state: &TrainerState,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut t = HashMap::new();
    for (i, n) in names.iter().enumerate() {
        t.insert(format!("m.{n}"), m[i].to_device(&Device::Cpu)?);
        t.insert(format!("v.{n}"), v[i].to_device(&Device::Cpu)?);
    }
    candle_core::safetensors::save(&t, dir.join("moments.safetensors"))?;
    std::fs::write(
        dir.join("state.json"),
        serde_json::to_string_pretty(state)? + "\n",
    )?;
    Ok(())
}

pub fn read_trainer_state(
    dir: &Path,
    names: &[String],
    device: &Device,
) -> Result<(Vec<Tensor>, Vec<Tensor>, TrainerState)> {
    let state: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(dir.join("state.json"))
            .with_context(|| format!("reading {}", dir.display()))?,
    )?;
    let t = candle_core::safetensors::load(dir.join("moments.safetensors"), device)?;
    let get = |k: String| {
        t.get(&k)
            .cloned()
            .with_context(|| format!("trainer state lacks {k}"))
    };
    let m = names
        .iter()
        .map(|n| get(format!("m.{n}")))
        .collect::<Result<_>>()?;
    let v = names
        .iter()
        .map(|n| get(format!("v.{n}")))
        .collect::<Result<_>>()?;
    Ok((m, v, state))
}

/// The file of a checkpoint directory that records the sha256 of every other file in it.
pub const CHECKSUMS: &str = "checksums.json";

fn sha256_file(p: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    std::io::copy(&mut f, &mut h).with_context(|| format!("reading {}", p.display()))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The files under `dir` (relative paths with `/`, sorted), `CHECKSUMS` aside.
fn files_under(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<()> {
    for e in std::fs::read_dir(dir.join(rel))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let r = match rel.is_empty() {
            true => name,
            false => format!("{rel}/{name}"),
        };
        if e.file_type()?.is_dir() {
            files_under(dir, &r, out)?;
        } else if r != CHECKSUMS {
            out.push(r);
        }
    }
    Ok(())
}

/// Record the sha256 of every file under `dir` in `dir/checksums.json`. Example:
/// `{"drafter/model.safetensors": "9f2c…", "trainer/state.json": "41d0…", …}`.
pub fn write_checksums(dir: &Path) -> Result<()> {
    let mut files = Vec::new();
    files_under(dir, "", &mut files)?;
    files.sort();
    let sums: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .map(|f| Ok((f.clone(), sha256_file(&dir.join(f))?.into())))
        .collect::<Result<_>>()?;
    write_file(
        &dir.join(CHECKSUMS),
        (serde_json::to_string_pretty(&sums)? + "\n").as_bytes(),
    )
}

/// Check the files of checkpoint `dir` against its `checksums.json` (a checkpoint written
/// before checksums has none and is taken as it is). Example: a byte of
/// `trainer/moments.safetensors` flipped after writing → "…/step-000012/trainer/
/// moments.safetensors does not match the sha256 …/checksums.json records for it".
pub fn verify_checksums(dir: &Path) -> Result<()> {
    let p = dir.join(CHECKSUMS);
    let Ok(text) = std::fs::read_to_string(&p) else {
        return Ok(());
    };
    let sums: HashMap<String, String> =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    let mut names: Vec<&String> = sums.keys().collect();
    names.sort();
    for f in names {
        let file = dir.join(f);
        if !file.is_file() {
            anyhow::bail!("{} is missing: {} records it", file.display(), p.display());
        }
        if sha256_file(&file)? != sums[f] {
            anyhow::bail!(
                "{} does not match the sha256 {} records for it (damaged after it was \
                 written?): resume from an earlier checkpoint (write its name into latest) or \
                 start again",
                file.display(),
                p.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_or_missing_file_is_named() {
        let dir = std::env::temp_dir().join(format!("dflash-sums-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("trainer")).unwrap();
        std::fs::write(dir.join("trainer/state.json"), b"{}").unwrap();
        std::fs::write(dir.join("top.bin"), [1u8, 2, 3]).unwrap();
        write_checksums(&dir).unwrap();
        verify_checksums(&dir).unwrap();
        std::fs::write(dir.join("top.bin"), [1u8, 2, 4]).unwrap();
        let e = verify_checksums(&dir).unwrap_err().to_string();
        assert!(e.contains("top.bin") && e.contains("does not match"), "{e}");
        std::fs::write(dir.join("top.bin"), [1u8, 2, 3]).unwrap();
        std::fs::remove_file(dir.join("trainer/state.json")).unwrap();
        let e = verify_checksums(&dir).unwrap_err().to_string();
        assert!(e.contains("state.json") && e.contains("missing"), "{e}");
        // a checkpoint from before checksums is taken as it is
        std::fs::remove_file(dir.join(CHECKSUMS)).unwrap();
        verify_checksums(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

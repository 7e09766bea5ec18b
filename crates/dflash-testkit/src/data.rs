//! Data directories for the trainer, written for a target directory.

use std::path::Path;

use dflash_core::sampling::SamplingParams;
use dflash_model::io::loader::identity_hash;
use dflash_train::data::{write_manifest, write_shard, Manifest, Sequence, ShardInfo, FORMAT};

/// A data directory of `seqs` for the target in `target_dir`.
pub fn write_data(dir: &Path, target_dir: &Path, seqs: &[Sequence]) {
    std::fs::create_dir_all(dir).unwrap();
    let sha256 = write_shard(&dir.join("shard-00000.jsonl"), seqs).unwrap();
    let m = Manifest {
        format: FORMAT.into(),
        target_hash: identity_hash(target_dir).unwrap(),
        target: target_dir.display().to_string(),
        chat_template_sha256: None,
        sampling: SamplingParams::default(),
        max_new_tokens: 0,
        loop_window: 0,
        source: "test".into(),
        prompts_per_shard: seqs.len(),
        shards: vec![ShardInfo {
            file: "shard-00000.jsonl".into(),
            sequences: seqs.len(),
            tokens: seqs.iter().map(|s| s.ids.len()).sum(),
            supervised_tokens: seqs.iter().map(|s| s.supervised()).sum(),
            ended_by_loop: 0,
            sha256: Some(sha256),
        }],
    };
    write_manifest(dir, &m).unwrap();
}

/// A deterministic pseudo-random sequence: `prompt` unsupervised tokens, then `resp` supervised.
pub fn sequence(seed: u32, prompt: usize, resp: usize) -> Sequence {
    let n = prompt + resp;
    let ids = (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
                >> 8)
                % 250
                + 1
        })
        .collect();
    let loss_mask = (0..n).map(|i| (i >= prompt) as u8).collect();
    Sequence { ids, loss_mask }
}

/// A private copy of the tiny target (named `name`) and a data directory of `seqs` written for
/// it: the trainer tests' setup.
pub fn tiny_data(name: &str, seqs: &[Sequence]) -> (std::path::PathBuf, std::path::PathBuf) {
    let td = crate::targets::tiny_target_dir(name);
    let data = crate::paths::tmp(&format!("{name}-data"));
    write_data(&data, &td, seqs);
    (td, data)
}

/// A private copy of the tiny target and a data directory of four sequences (seeds
/// `first..first+4`, prompt 4, response `resp`) written for it.
pub fn four_sequences(
    name: &str,
    first: u32,
    resp: usize,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let seqs: Vec<Sequence> = (0..4).map(|i| sequence(first + i, 4, resp)).collect();
    tiny_data(name, &seqs)
}

/// Every shard file of a data directory (`shard-*`), in name order, as bytes: what two runs
/// must write alike.
pub fn shard_files(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("shard-"))
        .collect();
    names.sort();
    names
        .iter()
        .map(|n| std::fs::read(dir.join(n)).unwrap())
        .collect()
}

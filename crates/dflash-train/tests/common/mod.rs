#![allow(dead_code)]
//! Test support: the tiny random Qwen3 target as a loadable directory (with a word-level
//! tokenizer over its 256 ids), and data directories written for it.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use dflash_core::sampling::SamplingParams;
use dflash_model::io::loader::{identity_hash, load_target, LoadedTarget};
use dflash_train::data::{write_manifest, write_shard, Manifest, Sequence, ShardInfo, FORMAT};

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dflash-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A private copy of tests/fixtures/qwen3-tiny (a random tiny Qwen3 with a word-level
/// tokenizer "t0" … "t255"), so a test may alter it.
pub fn tiny_target_dir(name: &str) -> PathBuf {
    let d = tmp(&format!("target-{name}"));
    for e in std::fs::read_dir(fixtures().join("qwen3-tiny")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

pub fn load(dir: &Path, dtype: DType) -> LoadedTarget {
    load_target(dir.to_str().unwrap(), dtype, &Device::Cpu).unwrap()
}

/// A data directory of `seqs` for the target in `target_dir`.
pub fn write_data(dir: &Path, target_dir: &Path, seqs: &[Sequence]) {
    std::fs::create_dir_all(dir).unwrap();
    write_shard(&dir.join("shard-00000.jsonl"), seqs).unwrap();
    let m = Manifest {
        format: FORMAT.into(),
        target_hash: identity_hash(target_dir).unwrap(),
        target: target_dir.display().to_string(),
        chat_template_sha256: None,
        sampling: SamplingParams::default(),
        max_new_tokens: 0,
        source: "test".into(),
        prompts_per_shard: seqs.len(),
        shards: vec![ShardInfo {
            file: "shard-00000.jsonl".into(),
            sequences: seqs.len(),
            tokens: seqs.iter().map(|s| s.ids.len()).sum(),
            supervised_tokens: seqs.iter().map(|s| s.supervised()).sum(),
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

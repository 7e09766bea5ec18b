//! The training side's readers under mutation: a data directory (its `manifest.json` by
//! JSON-aware mutations; a shard's JSONL by byte and JSON mutations, its manifest sha256 kept
//! matching so the parser sees the bytes, or not, so the checksum refuses them), a JSONL prompt
//! file, a ShareGPT file, a training config and a checkpoint's trainer state. Seeds: the test data of `dflash_testkit`
//! (sequences written by `data::write_shard`), prompt files in the formats `data generate`
//! reads, `TrainConfig::default()`. Every case ends in `Ok` or a clear error
//! ([`dflash_testkit::fuzz`]); the long runs are `-- --ignored fuzz_readers_long`.

use dflash_testkit::fuzz::{
    fuzz, mutate_json, mutate_jsonl, mutate_safetensors, small_u64s, Counting, Counts,
};
use dflash_train::config::TrainConfig;
use rand::Rng;
use sha2::Digest;

#[global_allocator]
static ALLOC: Counting = Counting;

fn sha256_hex(b: &[u8]) -> String {
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// `cases` data directories: the case's first byte says what was mutated (0: the manifest,
/// 1: the shard with a matching sha256, 2: the shard as damaged after writing).
fn fuzz_data(cases: usize, rng_seed: u64) -> Counts {
    let seqs: Vec<_> = (0..4)
        .map(|i| dflash_testkit::sequence(10 + i, 5, 9))
        .collect();
    let (_, dir) = dflash_testkit::tiny_data(&format!("fuzz-data-{rng_seed}"), &seqs);
    let manifest = std::fs::read(dir.join("manifest.json")).unwrap();
    let shard = std::fs::read(dir.join("shard-00000.jsonl")).unwrap();
    fuzz(
        "data directory",
        &[&[0u8][..], &manifest].concat(),
        cases,
        rng_seed,
        |_, rng| {
            let which = rng.random_range(0..3u8);
            let body = match which {
                0 => mutate_json(&manifest, rng),
                _ => mutate_jsonl(&shard, rng),
            };
            [&[which][..], &body].concat()
        },
        |case| {
            let (m, s) = match case[0] {
                0 => (case[1..].to_vec(), shard.clone()),
                which => {
                    let mut m: serde_json::Value = serde_json::from_slice(&manifest)?;
                    if which == 1 {
                        m["shards"][0]["sha256"] = sha256_hex(&case[1..]).into();
                    }
                    (serde_json::to_vec(&m)?, case[1..].to_vec())
                }
            };
            std::fs::write(dir.join("manifest.json"), &m)?;
            std::fs::write(dir.join("shard-00000.jsonl"), &s)?;
            dflash_train::data::read_sequences(&dir).map(drop)
        },
    )
}

/// A prompt file of each format `data generate` reads, by the case's first byte: 0 JSONL
/// (`{"prompt"}`, `{"messages"}` and `{"turns"}` lines), 1 ShareGPT.
fn fuzz_prompts(cases: usize, rng_seed: u64) -> Counts {
    let jsonl = concat!(
        "{\"prompt\": \"What is 2 + 2?\"}\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}]}\n",
        "{\"turns\": [\"Name a color.\", \"Another?\"], \"id\": 7}\n"
    )
    .as_bytes()
    .to_vec();
    let sharegpt = serde_json::to_vec(&serde_json::json!([
        {"id": "a", "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Two plus two?"}]}
    ]))
    .unwrap();
    let dir = dflash_testkit::tmp(&format!("fuzz-prompts-{rng_seed}"));
    fuzz(
        "prompt files",
        &[&[0u8][..], &jsonl].concat(),
        cases,
        rng_seed,
        |_, rng| match rng.random_range(0..2u8) {
            0 => [&[0u8][..], &mutate_jsonl(&jsonl, rng)].concat(),
            _ => [&[1u8][..], &mutate_json(&sharegpt, rng)].concat(),
        },
        |case| {
            let (name, body) = (["p.jsonl", "sharegpt.json"][case[0] as usize], &case[1..]);
            let p = dir.join(name);
            std::fs::write(&p, body)?;
            match case[0] {
                0 => dflash_train::prompts::jsonl(&p, None, false).map(drop),
                _ => dflash_train::prompts::load(&format!("sharegpt:{}", p.display()), 0).map(drop),
            }
        },
    )
}

/// Training configs: JSON-aware mutations of the default config, parsed and validated as
/// `train --config` does.
fn fuzz_config(cases: usize, rng_seed: u64) -> Counts {
    let seed = serde_json::to_vec(&TrainConfig::default()).unwrap();
    fuzz(
        "training config",
        &seed,
        cases,
        rng_seed,
        mutate_json,
        |b| {
            let c: TrainConfig = serde_json::from_slice(b)?;
            c.validate()
        },
    )
}

/// A checkpoint's trainer state (`state.json` by JSON-aware mutations, `moments.safetensors`
/// by header and byte mutations), read as a resumed run reads it; the seed: AdamW moments of
/// two small tensors written by `write_trainer_state`.
fn fuzz_trainer_state(cases: usize, rng_seed: u64) -> Counts {
    use candle_core::{Device, Tensor};
    use dflash_train::checkpoint::{read_trainer_state, write_trainer_state, TrainerState};
    let dir = dflash_testkit::tmp(&format!("fuzz-trainer-state-{rng_seed}"));
    let names = vec!["a.weight".to_string(), "b.bias".to_string()];
    let t = |n: usize| Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap();
    let state = TrainerState {
        steps_done: 12,
        epoch: 1,
        position: 3,
        adam_step: 12,
        best_val_loss: Some(2.5),
    };
    write_trainer_state(&dir, &names, &[t(6), t(3)], &[t(6), t(3)], &state).unwrap();
    let files = ["state.json", "moments.safetensors"];
    let seeds: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect();
    fuzz(
        "trainer state",
        &[&[0u8][..], &seeds[0]].concat(),
        cases,
        rng_seed,
        |_, rng| match rng.random_range(0..2u8) {
            0 => [&[0u8][..], &mutate_json(&seeds[0], rng)].concat(),
            _ => [
                &[1u8][..],
                &mutate_safetensors(&seeds[1], &small_u64s(&seeds[1]), rng),
            ]
            .concat(),
        },
        |case| {
            let which = case[0] as usize;
            std::fs::write(dir.join(files[which]), &case[1..])?;
            let r = read_trainer_state(&dir, &names, &Device::Cpu).map(drop);
            std::fs::write(dir.join(files[which]), &seeds[which])?;
            r
        },
    )
}

#[test]
fn fuzz_readers_seeded() {
    for (name, c) in [
        ("data", fuzz_data(1_500, 1)),
        ("prompts", fuzz_prompts(1_500, 2)),
        ("config", fuzz_config(1_500, 3)),
        ("trainer state", fuzz_trainer_state(1_500, 4)),
    ] {
        eprintln!("{name}: {c:?}");
        assert!(c.ok > 0 && c.errors > 0, "{name}: {c:?}");
    }
}

/// The long run: 100,000 cases per reader; prints one JSON object per reader
/// (docs/bench/fuzz-readers-*).
#[test]
#[ignore]
fn fuzz_readers_long() {
    for (reader, c) in [
        ("data directory", fuzz_data(100_000, 7)),
        ("prompt files", fuzz_prompts(100_000, 8)),
        ("training config", fuzz_config(100_000, 9)),
        ("trainer state", fuzz_trainer_state(100_000, 10)),
    ] {
        println!("{}", serde_json::json!({"reader": reader, "counts": c}));
    }
}
